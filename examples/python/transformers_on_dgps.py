#!/usr/bin/env python3
"""Hugging Face Qwen3-Next (and Kimi Linear, where the installed transformers has it) with the gated-delta-rule
kernel calls pointed at dgps_torch, checked against the same model on transformers' own torch implementation:
logits within bfloat16 tolerance, greedy tokens identical, one training step's gradients close.

    PYTHONPATH=<dgps_torch install> python3 examples/python/transformers_on_dgps.py [--device cuda] [--tokens 32]

A small random configuration (no weights are downloaded). Exit status 0 when every check holds, 1 otherwise.
"""
import argparse
import copy
import sys
import time

import torch

import dgps_torch


def rel_l2(a, b):
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class Kernels:
    """Points a model's linear-attention kernel calls at the functions of `table` (name -> function). A layer that
    keeps its kernels as instance attributes (set in its __init__) is patched in place; where no layer has them,
    the layers resolve the names in the modeling module at call time (`chunk_gated_delta_rule`, or, in
    transformers 5.x, the module functions `torch_chunk_gated_delta_rule` themselves), and `activate()` sets them
    there before each use of the model."""

    def __init__(self, model, mod, table):
        self.mod, self.table, self.globals = mod, table, False
        self.count = 0
        for m in model.modules():
            for attr, fn in table.items():
                if attr in vars(m):
                    setattr(m, attr, fn)
                    self.count += 1
        if self.count == 0:
            for prefix in ("", "torch_"):
                if all(hasattr(mod, prefix + a) for a in table):
                    self.table = {prefix + a: fn for a, fn in table.items()}
                    self.globals, self.count = True, len(table)
                    break
        if self.count == 0:
            import inspect
            src = inspect.getsource(mod).splitlines()
            lines = [f"{i + 1}: {l.strip()}" for i, l in enumerate(src) if "delta" in l or "kda" in l.lower()]
            raise AssertionError(f"{mod.__name__}: no kernel attribute {sorted(table)} on any layer nor in the module;"
                                 " its lines naming the kernels:\n" + "\n".join(lines[:60]))

    def activate(self):
        if self.globals:
            for attr, fn in self.table.items():
                setattr(self.mod, attr, fn)


def qwen3_next(dev):
    """Qwen3-Next: three gated-delta-rule layers and one attention layer; 4 key heads, 8 value heads, K = V = 128."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_next import modeling_qwen3_next as mod
    cfg = Qwen3NextConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
                          linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
                          num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                          shared_expert_intermediate_size=256, max_position_embeddings=4096, pad_token_id=0,
                          eos_token_id=None, bos_token_id=None)
    model = Qwen3NextForCausalLM(cfg).to(dev)
    ref = {"chunk_gated_delta_rule": mod.torch_chunk_gated_delta_rule,
           "recurrent_gated_delta_rule": mod.torch_recurrent_gated_delta_rule}
    ours = {"chunk_gated_delta_rule": dgps_torch.chunk_gated_delta_rule,
            "recurrent_gated_delta_rule": dgps_torch.fused_recurrent_gated_delta_rule}
    return model, mod, ref, ours


def kimi_linear(dev):
    """Kimi Linear: three KDA layers and one MLA layer (field names differ between transformers versions: the
    linear-attention ones are given both ways)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    from transformers.models.kimi_linear import modeling_kimi_linear as mod
    cfg = KimiLinearConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=128,
                           qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=64, num_experts_per_tok=2,
                           num_local_experts=8, max_position_embeddings=4096, pad_token_id=0, eos_token_id=None,
                           bos_token_id=None,
                           linear_attn_config={"head_dim": 128, "num_heads": 4, "short_conv_kernel_size": 4})
    model = KimiLinearForCausalLM(cfg).to(dev)
    ref = {"chunk_kda": mod.torch_chunk_kda, "recurrent_kda": mod.torch_recurrent_kda}
    ours = {"chunk_kda": dgps_torch.chunk_kda, "recurrent_kda": dgps_torch.fused_recurrent_kda}
    return model, mod, ref, ours


def check(name, build, args):
    """Runs the three comparisons for one model; returns the list of failed checks."""
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    base, mod, ref_fns, our_fns = build(dev)
    failed = []
    for dtype in (torch.bfloat16, torch.float32):
        tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
        ref = copy.deepcopy(base).to(dtype)
        ours = copy.deepcopy(base).to(dtype)
        kr, ko = Kernels(ref, mod, ref_fns), Kernels(ours, mod, our_fns)
        if dtype == torch.bfloat16:
            print(f"{name}: {ko.count} kernel references patched" + (" (module globals)" if ko.globals else ""))
        g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
        ids = torch.randint(1, ref.config.vocab_size, (args.batch, args.prompt), generator=g).to(dev)
        tag = f"{name} {str(dtype).replace('torch.', '')}"

        ref.eval(), ours.eval()
        with torch.no_grad():
            kr.activate()
            t0 = time.perf_counter()
            lr = ref(ids).logits.float()
            t1 = time.perf_counter()
            ko.activate()
            lo = ours(ids).logits.float()
            t2 = time.perf_counter()
        e = rel_l2(lo, lr)
        print(f"{tag}: logits rel L2 {e:.2e} (tol {tol:g}), max abs {float((lo - lr).abs().max()):.3e}; "
              f"forward torch {1e3 * (t1 - t0):.1f} ms, dgps {1e3 * (t2 - t1):.1f} ms")
        if not e <= tol:
            failed.append(f"{tag} logits")

        with torch.no_grad():
            kw = dict(max_new_tokens=args.tokens, do_sample=False, min_new_tokens=args.tokens)
            kr.activate()
            gr = ref.generate(ids[:1, :32], **kw)[0, 32:].tolist()
            ko.activate()
            go = ours.generate(ids[:1, :32], **kw)[0, 32:].tolist()
        same = sum(1 for _ in zip(gr, go)) if gr == go else next(i for i, (a, b) in enumerate(zip(gr, go)) if a != b)
        print(f"{tag}: greedy {len(go)} tokens, identical prefix {same} / {len(gr)}")
        if gr != go:
            failed.append(f"{tag} greedy")

        ref.train(), ours.train()
        grads = []
        for m, k in ((ref, kr), (ours, ko)):
            k.activate()
            m.zero_grad(set_to_none=True)
            m(ids, labels=ids).loss.backward()
            grads.append({n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None})
        worst = max(((rel_l2(grads[1][n], grads[0][n]), n) for n in grads[0]), key=lambda t: t[0])
        gtol = 5e-2 if dtype == torch.bfloat16 else 1e-3
        print(f"{tag}: {len(grads[0])} gradients, worst rel L2 {worst[0]:.2e} ({worst[1]}; tol {gtol:g})")
        if set(grads[0]) != set(grads[1]) or not worst[0] <= gtol:
            failed.append(f"{tag} gradients")
    return failed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens generated")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256, help="prompt length for the logits and gradients")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    failed, ran = [], 0
    for name, build in (("Qwen3-Next", qwen3_next), ("Kimi Linear", kimi_linear)):
        try:
            f = check(name, build, args)
        except (ImportError, RuntimeError, TypeError, ValueError) as err:
            if name == "Qwen3-Next":
                raise
            print(f"{name}: skipped ({type(err).__name__}: {err})")
            continue
        ran += 1
        failed += f
    print("all checks hold" if not failed else "FAILED: " + ", ".join(failed), f"({ran} models)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
