#!/usr/bin/env python3
"""Kernel error on a Hugging Face model's own inputs: separates what the linear-attention kernel contributes to a
bfloat16 training step's gate-parameter gradients from what the rest of the model adds.

The bfloat16 model of examples/python/transformers_on_dgps.py (Qwen3-Next or Kimi Linear, same configuration and
seed) runs one training step on transformers' torch kernels while every chunked kernel call records its inputs
(q, k, v, g, beta as the model passes them) and the gradient of its output. Each recorded call is then evaluated
alone, on exactly those inputs, by
  torch      transformers' torch kernel (float32 arithmetic on the bfloat16 inputs),
  dgps       dgps_torch on the device (the bfloat16 chunkwise kernels),
against a float64 gold (dgps's float64 CPU kernels on the same values). Printed per call, relative L2 errors of
o, dq, dk, dv, dg, dbeta and of "gsum" = sum over tokens (and key channels) of dg * g per value head: the call's
whole contribution to dA_log (g = -exp(A_log) softplus(...), so dA_log = gsum). "cancel" is |gsum| / sum |dg g|
per head (minimum over heads): how much of the sum cancels, which multiplies every per-token error.

    PYTHONPATH=<dgps_torch install> python3 python/scripts/model_kernel_error.py [--model kimi|qwen] [--seed 0]
"""
import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python"))
import transformers_on_dgps as hf  # noqa: E402

NAMES = ["o", "dq", "dk", "dv", "dg", "dbeta", "gsum"]


def record(model_fn, dev, seed, batch, prompt):
    """The recorded calls of one bfloat16 training step on the torch kernels: [(inputs, kwargs, dO)]."""
    torch.manual_seed(seed)
    base, mod, ref, _ = model_fn(dev)
    chunk_name = next(n for n in ref if n.startswith("chunk") or n.startswith("torch_chunk"))
    ref_chunk, calls = ref[chunk_name], []

    def rec(q, k, v, g, beta, **kw):
        entry = [[x.detach().clone() for x in (q, k, v, g, beta)], dict(kw), None]
        o, s = ref_chunk(q, k, v, g=g, beta=beta, **kw)
        if o.requires_grad:
            o.register_hook(lambda grad: entry.__setitem__(2, grad.detach().clone()))
        calls.append(entry)
        return o, s

    m = copy.deepcopy(base).to(torch.bfloat16)
    k = hf.Kernels(m, mod, {**ref, chunk_name: rec})
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    ids = torch.randint(1, base.config.vocab_size, (batch, prompt), generator=g).to(dev)
    m.train()
    k.activate()
    m(ids, labels=ids).loss.backward()
    return ref_chunk, [c for c in calls if c[2] is not None]


def evaluate(fn, inputs, kw, do, dev, cast):
    """o, dq, dk, dv, dg, dbeta, gsum of sum(o * dO) through `fn` on the inputs moved to `dev` (cast(x) per input)."""
    leaves = [cast(x).to(dev).requires_grad_() for x in inputs]
    kw = {n: v for n, v in kw.items() if n in ("use_qk_l2norm_in_kernel", "scale", "chunk_size")}
    q, k, v, g, beta = leaves
    o = fn(q, k, v, g=g, beta=beta, **kw)[0]
    gd = torch.float64 if o.dtype == torch.float64 else torch.float32
    (o.to(gd) * do.to(dev, gd)).sum().backward()
    dg = leaves[3].grad
    prod = (dg.double() * g.detach().double())
    dims = [0, 1, 3] if prod.dim() == 4 else [0, 1]
    gsum, gabs = prod.sum(dims), prod.abs().sum(dims)
    out = [o.detach()] + [x.grad for x in leaves[:3]] + [dg, leaves[4].grad, gsum]
    return [x.double().cpu() for x in out], float((gsum.abs() / gabs.clamp_min(1e-300)).min())


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def main():
    import dgps_torch
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="kimi", choices=["kimi", "qwen"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256)
    args = ap.parse_args()
    model_fn = hf.kimi_linear if args.model == "kimi" else hf.qwen3_next
    ours = dgps_torch.chunk_kda if args.model == "kimi" else dgps_torch.chunk_gated_delta_rule
    ref_chunk, calls = record(model_fn, args.device, args.seed, args.batch, args.prompt)
    print(f"{args.model}, seed {args.seed}: {len(calls)} recorded calls (layer order); relative L2 error to the "
          f"float64 gold on the call's own inputs")
    print("| call | kernel | " + " | ".join(NAMES) + " | cancel |")
    print("|" + "---|" * (3 + len(NAMES)))
    for i, (inputs, kw, do) in enumerate(calls):
        gold, cancel = evaluate(ours, inputs, kw, do, "cpu", lambda x: x.double())
        for name, fn in (("torch", ref_chunk), ("dgps", ours)):
            res, _ = evaluate(fn, inputs, kw, do, args.device, lambda x: x.clone())
            cells = " | ".join(f"{rel(a, b):.2e}" for a, b in zip(res, gold))
            print(f"| {i} | {name} | {cells} | {cancel:.2e} |", flush=True)


if __name__ == "__main__":
    main()
