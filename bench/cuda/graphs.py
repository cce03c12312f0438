"""@brief CUDA-graph capture shared by the Python benchmarks beside bench_cuda (fla_bench.py, torch_vs_fla.py)."""
import torch


def graphed(fn, calls=1):
    """fn captured `calls` times into one CUDA graph, after 3 warm-up calls on a side stream (as torch's capture
    needs); returns the graph's replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g.replay
