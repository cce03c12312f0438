"""@brief dgps_torch against FLA through PyTorch, side by side in one run: forward and forward + backward, timed
eagerly and as CUDA graph replays.

Same call for both (FLA's function names, bfloat16 q/k/v, float32 gates, K = V = 128, use_qk_l2norm_in_kernel):
dgps_torch's chunk_* functions and FLA's. Times with CUDA events, median of 20 after 5 warm-ups; the graph rows
capture one call (forward, or forward + backward through autograd) and time its replay. Prints a markdown table.
FLA is not part of dgps: it is imported from PYTHONPATH (a checkout's `fla` folder); without it only dgps is timed.

    python3 bench/cuda/torch_vs_fla.py [models, default gdn,pgdn,kda,pkda,dn,gla,sgla]
                                       [shapes, default 8x2048x16,1x32768x16]

Models: gdn chunk_gated_delta_rule, pgdn chunk_precond_gated_delta_rule, kda chunk_kda, pkda chunk_precond_kda,
dn chunk_delta_rule, gla chunk_gla, sgla chunk_simple_gla (the last two without the in-kernel L2 norm, which FLA's
GLA functions do not take).
"""
import importlib
import statistics
import sys

import torch
import torch.nn.functional as F

import dgps_torch
from graphs import graphed

dev = "cuda"


def median_ms(fn, warm=5, reps=20):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    return statistics.median(ts)


def call(lib, model, t):
    """model's chunk function of `lib` (dgps_torch or FLA) on the tensors t; returns o."""
    q, k, v, g, beta, g_atk, beta_atk, center = t
    if model == "gdn":
        return lib["chunk_gated_delta_rule"](q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    if model == "kda":
        return lib["chunk_kda"](q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    if model == "dn":
        return lib["chunk_delta_rule"](q, k, v, beta, use_qk_l2norm_in_kernel=True)[0]
    if model == "gla":
        return lib["chunk_gla"](q, k, v, g)[0]
    if model == "sgla":
        return lib["chunk_simple_gla"](q, k, v, g)[0]
    if model == "pgdn":
        return lib["chunk_precond_gated_delta_rule"](q, k, v, g_atk, g, beta_atk, beta, use_qk_l2norm_in_kernel=True,
                                                     log_atk_scale=center)[0]
    return lib["chunk_precond_kda"](q, k, v, g, g_atk, beta_atk, beta, use_qk_l2norm_in_kernel=True,
                                    log_atk_scale=center)[0]


def tensors(model, B, T, H, K=128, V=128, grad=False):
    torch.manual_seed(0)
    diag = model in ("kda", "pkda", "gla")
    r = lambda *s, dt=torch.bfloat16: torch.randn(*s, device=dev, dtype=dt)
    g = F.logsigmoid(r(B, T, H, K, dt=torch.float32)) if diag else F.logsigmoid(r(B, T, H, dt=torch.float32))
    t = [r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), g, torch.sigmoid(r(B, T, H, dt=torch.float32)),
         F.logsigmoid(r(B, T, H, dt=torch.float32)), torch.sigmoid(r(B, T, H, dt=torch.float32)),
         r(H, dt=torch.float32)]
    return [x.requires_grad_(grad) for x in t]


def time_one(lib, model, B, T, H):
    """{case: ms} for forward / forward + backward, eager / graph; a failing case gives its error text."""
    res = {}
    t = tensors(model, B, T, H)
    fwd = lambda: call(lib, model, t)
    tg = tensors(model, B, T, H, grad=True)
    do = torch.randn(B, T, H, 128, device=dev, dtype=torch.bfloat16)
    leaves = tg if model in ("pgdn", "pkda") else [tg[i] for i in {"dn": (0, 1, 2, 4), "gla": (0, 1, 2, 3),
                                                                   "sgla": (0, 1, 2, 3)}.get(model, range(5))]

    def step():
        for x in leaves:
            x.grad = None
        call(lib, model, tg).backward(do)

    for case, fn in (("fwd", fwd), ("fwd+bwd", step)):
        for mode in ("eager", "graph"):
            try:
                with torch.no_grad() if case == "fwd" else torch.enable_grad():
                    res[f"{case} {mode}"] = median_ms(fn if mode == "eager" else graphed(fn))
            except Exception as e:  # one failing case must not stop the table
                res[f"{case} {mode}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
            torch.cuda.synchronize()
    return res


def main():
    models = (sys.argv[1] if len(sys.argv) > 1 else "gdn,pgdn,kda,pkda,dn,gla,sgla").split(",")
    shapes = [tuple(map(int, s.split("x"))) for s in (sys.argv[2] if len(sys.argv) > 2 else
                                                       "8x2048x16,1x32768x16").split(",")]
    libs = {"dgps": {n: getattr(dgps_torch, n) for n in dir(dgps_torch) if n.startswith("chunk_")}}
    try:
        fla = {n: getattr(importlib.import_module(m), n) for m, n in (
            ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"), ("fla.ops.kda", "chunk_kda"),
            ("fla.ops.precond_gated_delta_rule", "chunk_precond_gated_delta_rule"),
            ("fla.ops.precond_kda", "chunk_precond_kda"), ("fla.ops.delta_rule", "chunk_delta_rule"),
            ("fla.ops.gla", "chunk_gla"), ("fla.ops.simple_gla", "chunk_simple_gla"))}
        # Timing only: FLA refuses its gated backward on Hopper with this Triton (wrong gradients there, FLA issue
        # #640); its time is measured, its gradients are never used.
        importlib.import_module("fla.ops.common.chunk_o").TRITON_ABOVE_3_7_1 = True
        libs["fla"] = fla
    except ImportError as e:
        print(f"FLA not importable ({e}): dgps only")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bfloat16, K = V = 128, ms (median of 20)")
    cases = ["fwd eager", "fwd graph", "fwd+bwd eager", "fwd+bwd graph"]
    print("| model | B x T x H | " + " | ".join(f"{lib} {c}" for c in cases for lib in libs)
          + (" | " + " | ".join(f"dgps/fla {c}" for c in cases) if "fla" in libs else "") + " |")
    print("|" + "---|" * (2 + len(cases) * len(libs) + (len(cases) if "fla" in libs else 0)))
    for m in models:
        for B, T, H in shapes:
            r = {lib: time_one(fns, m, B, T, H) for lib, fns in libs.items()}
            cells = [r[lib][c] for c in cases for lib in libs]
            fmt = lambda x: f"{x:.3f}" if isinstance(x, float) else str(x)
            line = f"| {m} | {B}x{T}x{H} | " + " | ".join(fmt(c) for c in cells)
            if "fla" in libs:
                ratio = lambda c: (f"{r['dgps'][c] / r['fla'][c]:.2f}" if all(isinstance(r[x][c], float)
                                                                            for x in ("dgps", "fla")) else "-")
                line += " | " + " | ".join(ratio(c) for c in cases)
            print(line + " |", flush=True)


if __name__ == "__main__":
    main()
