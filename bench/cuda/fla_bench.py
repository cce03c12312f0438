"""@brief FLA side of bench/cuda: the same shapes as bench_cuda on the same GPU, for dgps/FLA ratios.

Times flash-linear-attention's forward kernels (chunk_* for prefill, fused_recurrent_* for decode)
and a training step's forward + backward through torch autograd (`fwdbwd_*`; backward alone: `bwd_*`)
with CUDA events: median of 30 runs after 5 warm-up runs (decode B=1: CUDA graph of 100 calls).
FLA is not part of dgps: this script imports it from PYTHONPATH (a checkout's `fla` folder).
Prints CSV rows `impl,model,case,ms,mem_bytes` (mem_bytes: the peak allocation of one forward +
backward above what was allocated before it; empty for other rows) and writes them to argv[1] when given.
argv[2] filters the cases, e.g. "gdn,pgdn,decode,bwd" (bwd: the forward + backward rows).
`--grid [file] [models]`: the plan grid of bench_cuda --grid (packed sequences, real models' head layouts),
FLA timed with and without CUDA graphs.
"""
import importlib
import itertools
import sys
import statistics

import torch
import torch.nn.functional as F

from graphs import graphed

from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from fla.ops.kda import chunk_kda
from fla.ops.precond_gated_delta_rule import chunk_precond_gated_delta_rule, fused_recurrent_precond_gated_delta_rule
from fla.ops.precond_kda import chunk_precond_kda

dev = "cuda"
rows = []


def median_ms(fn, warm=5, reps=30):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


def emit(model, case, ms, mem_bytes=None):
    """Prints a CSV row and rewrites argv[1] with every row so far."""
    mem = "" if mem_bytes is None else str(mem_bytes)
    rows.append((model, case, ms, mem))
    print(f"fla,{model},{case},{ms:.4f},{mem}", flush=True)
    if len(sys.argv) > 1:  # written row by row, so a run cut short still leaves its rows
        with open(sys.argv[1], "w") as f:
            f.write("impl,model,case,ms,mem_bytes\n")
            for m, c, t, b in rows:
                f.write(f"fla,{m},{c},{t:.5f},{b}\n")


def inputs(B, T, H, HV, K, V, diag=False):
    q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, T, HV, V, device=dev, dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(B, T, HV, K if diag else 1, device=dev, dtype=torch.float32))
    if not diag:
        g = g.squeeze(-1).contiguous()
    beta = torch.sigmoid(torch.randn(B, T, HV, device=dev, dtype=torch.float32))
    g_atk = F.logsigmoid(torch.randn(B, T, H, device=dev, dtype=torch.float32))
    beta_atk = torch.sigmoid(torch.randn(B, T, H, device=dev, dtype=torch.float32))
    center = torch.randn(H, device=dev, dtype=torch.float32)
    return q, k, v, g, beta, g_atk, beta_atk, center


def chunk_fn(model, t, **kw):
    """The call of FLA's chunk function of `model` on the tensors t of inputs() (l2 norm in the kernel where the
    function takes it), with the keywords kw; returns a closure running it."""
    q, k, v, g, beta, g_atk, beta_atk, center = t
    if model == "gdn":
        return lambda: chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, **kw)
    if model == "pgdn":
        return lambda: chunk_precond_gated_delta_rule(q, k, v, g_atk, g, beta_atk, beta, use_qk_l2norm_in_kernel=True,
                                                      log_atk_scale=center, **kw)
    if model == "pkda":
        return lambda: chunk_precond_kda(q, k, v, g, g_atk, beta_atk, beta, log_atk_scale=center, **kw)
    return lambda: chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, **kw)


def forward(model, B, T, H, K=128, V=128):
    t = inputs(B, T, H, H, K, V, diag=model in ("pkda", "kda"))
    emit(model, f"fwd_B{B}_T{T}_H{H}", median_ms(chunk_fn(model, t, output_final_state=True)))


def allow_hopper_gated_backward():
    """TIMING ONLY: lets FLA run its gated backward on Hopper with Triton >= 3.4, < 3.7.1.

    FLA's chunk_bwd_dqkwg (fla/ops/common/chunk_o.py) raises there, because that Triton miscompiles
    it into wrong gradients (FLA issue #640). Pretending Triton >= 3.7.1 lets the same kernels run so
    their time can be measured; the gradients of that path are NOT trusted and are never compared.
    """
    importlib.import_module("fla.ops.common.chunk_o").TRITON_ABOVE_3_7_1 = True


def training(model, B, T, H, K=128, V=128):
    """Forward + backward of o = model(...) with the gradient of sum(o * do) for every input, and backward alone."""
    t = inputs(B, T, H, H, K, V, diag=model in ("pkda", "kda"))
    leaves = [x.requires_grad_() for x in t]
    if model in ("gdn", "kda"):  # (no preconditioner inputs)
        leaves = leaves[:5]
    do = torch.randn_like(t[2])
    call = chunk_fn(model, t)
    fwd = lambda: call()[0]

    def clear():
        """Drops the gradients of the previous step (so none are accumulated)."""
        for x in leaves:
            x.grad = None

    def step():
        """One training step's recurrence: forward, then backward from do."""
        clear()
        fwd().backward(do)  # the gradient of loss = (o * do).sum()

    case = f"B{B}_T{T}_H{H}"
    ms = median_ms(step)
    clear()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    emit(model, "fwdbwd_" + case, ms, torch.cuda.max_memory_allocated() - base)
    clear()
    o = fwd()
    emit(model, "bwd_" + case, median_ms(lambda: torch.autograd.grad(o, leaves, do, retain_graph=True)))


def decode(model, B, H, HV, K=128, V=128, graph=False):
    q, k, v, g, beta, g_atk, beta_atk, center = inputs(B, 1, H, HV, K, V)
    h0 = torch.randn(B, HV, K, V, device=dev, dtype=torch.float32)
    a0 = torch.rand(B, H, K, device=dev, dtype=torch.float32)
    if model == "gdn":
        fn = lambda: fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0,
                                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
    else:
        fn = lambda: fused_recurrent_precond_gated_delta_rule(q, k, v, g=g, beta=beta, g_atk=g_atk,
                                                              beta_atk=beta_atk, initial_state=h0,
                                                              initial_A_state=a0, output_final_state=True,
                                                              use_qk_l2norm_in_kernel=True, log_atk_scale=center)
    case = f"decode_B{B}_HV{HV}"
    if graph:
        ms = graph_ms(fn, max_calls=100)
        case += "_graph"
    else:
        ms = median_ms(fn)
    emit(model, case, ms)


GRID_LAYOUTS = (("1024x8", [1024] * 8), ("2048x4", [2048] * 4), ("4096x8", [4096] * 8), ("8192x4", [8192] * 4),
                ("1x2048", [2048]), ("1x8192", [8192]), ("1x32768", [32768]), ("28672+4096", [28672, 4096]))
GRID_HEADS = ((2, 8), (4, 16), (8, 32), (16, 16), (16, 32), (16, 64), (32, 32))


def graph_ms(fn, max_calls=20):
    """Median ms of one call of fn replayed from a CUDA graph: G calls per graph (about 3 ms a replay, at most
    max_calls), 20 replays after 5 warm-up ones."""
    eager = median_ms(fn, warm=1, reps=3)
    calls = max(1, min(max_calls, int(3.0 / max(eager, 1e-3))))
    return median_ms(graphed(fn, calls), warm=5, reps=20) / calls


def grid(only, out):
    """FLA's side of bench_cuda --grid: the forward of GDN, PGDN, KDA and PKDA on the same packed layouts and
    head counts (cu_seqlens, bf16, K = V = 128, final state out), timed with and without CUDA graphs.
    Rows `grid,model,layout,hqk,hv,ms_graph,ms_eager` (also written to `out`)."""
    lines = ["model,layout,hqk,hv,ms_graph,ms_eager"]
    print("grid,model,layout,hqk,hv,ms_graph,ms_eager", flush=True)
    for m in ("gdn", "pgdn", "kda", "pkda"):
        if only and m not in only:
            continue
        for name, lens in GRID_LAYOUTS:
            for H, HV in GRID_HEADS:
                T = sum(lens)
                cu = torch.tensor([0] + list(itertools.accumulate(lens)), device=dev, dtype=torch.int32)
                t = inputs(1, T, H, HV, 128, 128, diag=m in ("pkda", "kda"))
                fn = chunk_fn(m, t, output_final_state=True, cu_seqlens=cu)
                try:
                    row = f"{m},{name},{H},{HV},{graph_ms(fn):.5f},{median_ms(fn, warm=3, reps=15):.5f}"
                except Exception as e:  # one failing FLA kernel must not stop the grid
                    row = f"{m},{name},{H},{HV},error: {type(e).__name__}: {str(e)[:120]},"
                print("grid," + row, flush=True)
                lines.append(row)
                if out:
                    with open(out, "w") as f:
                        f.write("\n".join(lines) + "\n")
                del t, fn
                torch.cuda.empty_cache()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--grid":  # --grid [file] [models]
        grid([x for x in (sys.argv[3] if len(sys.argv) > 3 else "").split(",") if x],
             sys.argv[2] if len(sys.argv) > 2 else None)
        return
    only = [x for x in (sys.argv[2] if len(sys.argv) > 2 else "").split(",") if x]  # e.g. "gdn,pgdn,decode"
    for m in ("gdn", "pgdn", "pkda", "kda"):
        if only and m not in only:
            continue
        for (B, T, H) in ((8, 2048, 16), (1, 32768, 16), (4, 8192, 32)):
            try:
                forward(m, B, T, H)
            except Exception as e:  # report and continue: one failing FLA kernel must not stop the table
                print(f"fla,{m},fwd_B{B}_T{T}_H{H},error: {type(e).__name__}: {str(e)[:200]}", flush=True)
    if not only or "bwd" in only:
        allow_hopper_gated_backward()
    for m, B, T in (("pgdn", 8, 2048), ("gdn", 8, 2048), ("pgdn", 1, 32768), ("kda", 8, 2048), ("pkda", 8, 2048)):
        if only and ("bwd" not in only or (len(only) > 1 and m not in only)):  # "bwd" or e.g. "gdn,bwd"
            continue
        try:
            training(m, B, T, 16)
        except Exception as e:  # FLA's backward may refuse (or fail) on this GPU and Triton
            print(f"fla,{m},fwdbwd_B{B}_T{T}_H16,error: {type(e).__name__}: {str(e)[:200]}", flush=True)
    for m in ("gdn", "pgdn"):
        if only and "decode" not in only:
            continue
        for B, graph in ((1, True), (64, False), (256, False)):
            try:
                decode(m, B, 16, 32, graph=graph)
            except Exception as e:
                print(f"fla,{m},decode_B{B},error: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
