"""@brief FLA side of bench/cuda: the same shapes as bench_cuda on the same GPU, for dgps/FLA ratios.

Times flash-linear-attention's forward kernels (chunk_* for prefill, fused_recurrent_* for decode)
with CUDA events: median of 30 runs after 5 warm-up runs (decode B=1: CUDA graph of 100 calls).
FLA is not part of dgps: this script imports it from PYTHONPATH (a checkout's `fla` folder).
Prints CSV rows `impl,model,case,ms` and writes them to argv[1] when given.
"""
import sys
import statistics

import torch
import torch.nn.functional as F

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


def emit(model, case, ms):
    rows.append((model, case, ms))
    print(f"fla,{model},{case},{ms:.4f}", flush=True)
    if len(sys.argv) > 1:  # written row by row, so a run cut short still leaves its rows
        with open(sys.argv[1], "w") as f:
            f.write("impl,model,case,ms\n")
            for m, c, t in rows:
                f.write(f"fla,{m},{c},{t:.5f}\n")


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


def forward(model, B, T, H, K=128, V=128):
    q, k, v, g, beta, g_atk, beta_atk, center = inputs(B, T, H, H, K, V, diag=model in ("pkda", "kda"))
    if model == "gdn":
        fn = lambda: chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    elif model == "pgdn":
        fn = lambda: chunk_precond_gated_delta_rule(q, k, v, g_atk, g, beta_atk, beta, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True, log_atk_scale=center)
    elif model == "pkda":
        fn = lambda: chunk_precond_kda(q, k, v, g, g_atk, beta_atk, beta, output_final_state=True,
                                       log_atk_scale=center)
    else:
        fn = lambda: chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    emit(model, f"fwd_B{B}_T{T}_H{H}", median_ms(fn))


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
        calls = 100
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            for _ in range(calls):
                fn()
        ms = median_ms(lambda: gr.replay(), warm=5, reps=20) / calls
        case += "_graph"
    else:
        ms = median_ms(fn)
    emit(model, case, ms)


def main():
    only = [x for x in (sys.argv[2] if len(sys.argv) > 2 else "").split(",") if x]  # e.g. "gdn,pgdn,decode"
    for m in ("gdn", "pgdn", "pkda", "kda"):
        if only and m not in only:
            continue
        for (B, T, H) in ((8, 2048, 16), (1, 32768, 16), (4, 8192, 32)):
            try:
                forward(m, B, T, H)
            except Exception as e:  # report and continue: one failing FLA kernel must not stop the table
                print(f"fla,{m},fwd_B{B}_T{T}_H{H},error: {type(e).__name__}: {str(e)[:200]}", flush=True)
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
