#!/usr/bin/env python3
"""Gate-gradient error of dgps_torch's kernels against a float64 gold, beside transformers' torch kernels.

The gate parameters of Qwen3-Next and Kimi Linear (A_log, dt_bias) get their gradients by summing the kernel's dg
over every token, so they show a kernel's precision where the per-token gradients do not. For each model (GDN:
scalar gate per head; KDA: one per key channel), gate regime and sequence length this prints the relative L2 error
against the float64 gold (the same bfloat16-valued inputs in float64 on dgps's CPU kernels) of o, dq, dk, dv,
dbeta, dg, dA_log and ddt_bias, for:
  dgps bf16   dgps_torch on the GPU with bfloat16 q, k, v (the chunkwise kernels),
  dgps fp32   the same inputs in float32 (the float32 recurrent backward),
  torch fp32  transformers' torch_chunk_gated_delta_rule (GDN, when transformers is installed): bfloat16 inputs,
              computed in float32.
Gate: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b); regime "qwen" draws A_log = log U(0, 16) and
dt_bias = 1 (Qwen3-Next's initialisation: mostly strong decay), "mild" A_log = log U(0.01, 0.1).

    python3 python/scripts/gate_grad_error.py [--models gdn,kda] [--lengths 64,256,2048] [--regimes qwen,mild]
"""
import argparse
import math

import torch
import torch.nn.functional as F

import dgps_torch

NAMES = ["o", "dq", "dk", "dv", "dbeta", "dg", "dA_log", "ddt_bias"]


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def inputs(model, B, T, H, HV, K, V, regime, seed):
    """Leaves (bfloat16-valued float64 tensors on the CPU): q, k, v, a, b, A_log, dt_bias, dO."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    bf = lambda x: x.to(torch.bfloat16).double()
    lo, hi = (0.0, 16.0) if regime == "qwen" else (0.01, 0.1)
    A = lo + (hi - lo) * torch.rand(HV, generator=g, dtype=torch.float64)
    A_log = A.clamp_min(1e-4).log()
    dt_bias = torch.ones(HV * K if model == "kda" else HV, dtype=torch.float64)
    a = r(B, T, HV, K) if model == "kda" else r(B, T, HV)
    return [bf(r(B, T, H, K)), bf(r(B, T, H, K)), bf(r(B, T, HV, V)), a, r(B, T, HV), A_log, dt_bias,
            bf(r(B, T, HV, V))]


def run(fn, model, leaves, dev, io_dtype, expand=False):
    """o and the gradients (NAMES order) of sum(o * dO) through the gate formed in float32 (float64 for the gold)."""
    q, k, v, a, b, A_log, dt_bias, dO = leaves
    gd = torch.float64 if io_dtype == torch.float64 else torch.float32
    t = [x.detach().to(dev, io_dtype).clone().requires_grad_() for x in (q, k, v)]
    p = [x.detach().to(dev, gd).clone().requires_grad_() for x in (a, b, A_log, dt_bias)]
    HV = v.shape[2]
    if model == "kda":
        g = -p[2].exp().view(HV, 1) * F.softplus(p[0] + p[3].view(HV, -1))
    else:
        g = -p[2].exp() * F.softplus(p[0] + p[3])
    g.retain_grad()
    beta = torch.sigmoid(p[1])
    qq, kk = t[0], t[1]
    if expand and HV != q.shape[2]:
        qq, kk = (x.repeat_interleave(HV // q.shape[2], dim=2) for x in (qq, kk))
    o = fn(qq, kk, t[2], g, beta)
    (o.to(gd) * dO.to(dev, gd)).sum().backward()
    return [o.detach()] + [x.grad for x in t] + [p[1].grad, g.grad, p[2].grad, p[3].grad]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gdn,kda")
    ap.add_argument("--lengths", default="64,256,2048")
    ap.add_argument("--regimes", default="qwen,mild")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", default="4,8", help="key heads, value heads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    H, HV = map(int, args.heads.split(","))
    K = V = 128
    dev = args.device
    torch_gdn = None
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as mod
        torch_gdn = mod.torch_chunk_gated_delta_rule
    except Exception as e:  # transformers missing or renamed: dgps only
        print(f"transformers' torch kernel not available ({type(e).__name__}); dgps only")
    where = torch.cuda.get_device_name() if dev == "cuda" else dev
    print(f"{where}; B={args.batch} H={H} HV={HV} K=V={K}; relative L2 error to the float64 gold")
    print("| model | regime | T | kernel | " + " | ".join(NAMES) + " |")
    print("|" + "---|" * (4 + len(NAMES)))
    for model in args.models.split(","):
        chunk = dgps_torch.chunk_kda if model == "kda" else dgps_torch.chunk_gated_delta_rule
        ours = lambda q, k, v, g, beta: chunk(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
        kernels = [("dgps bf16", ours, torch.bfloat16, False), ("dgps fp32", ours, torch.float32, False)]
        if model == "gdn" and torch_gdn is not None:
            kernels.append(("torch fp32", lambda q, k, v, g, beta: torch_gdn(
                q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0], torch.bfloat16, True))
        for regime in args.regimes.split(","):
            for T in map(int, args.lengths.split(",")):
                leaves = inputs(model, args.batch, T, H, HV, K, V, regime, args.seed)
                gold = run(ours, model, leaves, "cpu", torch.float64)
                for name, fn, dt, expand in kernels:
                    res = run(fn, model, leaves, dev, dt, expand)
                    errs = [rel(x, y) for x, y in zip(res, gold)]
                    cells = " | ".join(f"{e:.2e}" if math.isfinite(e) else "nan" for e in errs)
                    print(f"| {model} | {regime} | {T} | {name} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
