#!/usr/bin/env python3
"""Hugging Face Qwen3-Next (and Kimi Linear, where the installed transformers has a torch KDA) with the
linear-attention kernel calls pointed at dgps_torch, checked against the same model on transformers' own torch
kernels. Both run in bfloat16 and in float32 on the device and are measured against a float64 gold (the model in
float64 on the CPU, on dgps's float64 CPU kernels): dgps's error in the logits and in every parameter's gradient
of one training step must be within 2x the torch kernels' own error at that precision (plus 1e-6 in float32,
1e-3 in bfloat16); in float32 the greedy tokens must equal the torch kernels' (in bfloat16 they are reported:
the near-tied logits of a random model flip under bfloat16 rounding either way).

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
    """Qwen3-Next: three gated-delta-rule layers and one attention layer; 4 key heads, 8 value heads, K = V = 128.
    Dense MLPs in every layer (mlp_only_layers): top-k expert routing would flip experts on rounding-level
    differences and turn them into large ones, whatever the kernels (and the grouped expert products take no
    float64, which the gold needs)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_next import modeling_qwen3_next as mod
    cfg = Qwen3NextConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
                          linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
                          num_experts=4, num_experts_per_tok=4, moe_intermediate_size=256,
                          shared_expert_intermediate_size=256, mlp_only_layers=[0, 1, 2, 3],
                          max_position_embeddings=4096, pad_token_id=0,
                          eos_token_id=None, bos_token_id=None)
    model = Qwen3NextForCausalLM(cfg).to(dev)
    ref = {"chunk_gated_delta_rule": mod.torch_chunk_gated_delta_rule,
           "recurrent_gated_delta_rule": mod.torch_recurrent_gated_delta_rule}
    ours = {"chunk_gated_delta_rule": dgps_torch.chunk_gated_delta_rule,
            "recurrent_gated_delta_rule": dgps_torch.fused_recurrent_gated_delta_rule}
    return model, mod, ref, ours


def kimi_linear(dev):
    """Kimi Linear: three KDA layers and one MLA layer (field names differ between transformers versions: the
    linear-attention ones are given both ways). Dense MLPs in every layer (first_k_dense_replace), as for
    Qwen3-Next: the grouped expert products take no float64."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    from transformers.models.kimi_linear import modeling_kimi_linear as mod
    cfg = KimiLinearConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=128,
                           qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=64, num_experts_per_tok=4,
                           num_local_experts=4, max_position_embeddings=4096, pad_token_id=0, eos_token_id=None,
                           bos_token_id=None, first_k_dense_replace=4,
                           linear_attn_config={"head_dim": 128, "num_heads": 4, "short_conv_kernel_size": 4,
                                               "kda_layers": [1, 2, 3], "full_attn_layers": [4]})
    # The torch KDA kernels' names: torch_chunk_kda / torch_recurrent_kda, or (transformers 5.17)
    # chunk_kimi_delta_attention / recurrent_kimi_delta_attention.
    for chunk, rec in (("chunk_kda", "recurrent_kda"),
                       ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")):
        if all(hasattr(mod, n) or hasattr(mod, "torch_" + n) for n in (chunk, rec)):
            break
    else:
        names = sorted(n for n in dir(mod) if "kda" in n.lower() or "delta" in n.lower())
        raise ImportError(f"{mod.__name__} has no torch KDA kernel to compare against (its KDA names: {names})")
    model = KimiLinearForCausalLM(cfg).to(dev)
    ref = {n: getattr(mod, n, None) or getattr(mod, "torch_" + n) for n in (chunk, rec)}
    ours = {chunk: dgps_torch.chunk_kda, rec: dgps_torch.fused_recurrent_kda}
    return model, mod, ref, ours


def run_model(m, k, ids, tokens):
    """Logits (float32), `tokens` greedy tokens after the first 32 prompt tokens of row 0, and every parameter's
    gradient (float32) of one training step's loss, with kernels `k`."""
    m.eval()
    with torch.no_grad():
        k.activate()
        t0 = time.perf_counter()
        logits = m(ids).logits.float()
        if ids.is_cuda:
            torch.cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - t0)
        kw = dict(max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
        greedy = m.generate(ids[:1, :32], **kw)[0, 32:].tolist()
    m.train()
    k.activate()
    m.zero_grad(set_to_none=True)
    m(ids, labels=ids).loss.backward()
    grads = {n: p.grad.float().cpu() for n, p in m.named_parameters() if p.grad is not None}
    return logits.cpu(), greedy, grads, ms


def prefix(a, b):
    """Length of the common prefix of two token lists."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check(name, build, args):
    """The comparisons for one model (module docstring); returns the list of failed checks."""
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    base, mod, ref_fns, our_fns = build(dev)
    g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    ids = torch.randint(1, base.config.vocab_size, (args.batch, args.prompt), generator=g)
    gold_m = copy.deepcopy(base).to("cpu", torch.float64)
    gold = run_model(gold_m, Kernels(gold_m, mod, our_fns), ids, args.tokens)
    del gold_m
    failed = []
    for dtype in (torch.bfloat16, torch.float32):
        floor = 1e-3 if dtype == torch.bfloat16 else 1e-6

        def limit(ref_err):
            """dgps's allowed error beside the torch kernels' `ref_err` at this precision."""
            return 2 * ref_err + floor

        tag = f"{name} {str(dtype).replace('torch.', '')}"
        ref_m, our_m = copy.deepcopy(base).to(dtype), copy.deepcopy(base).to(dtype)
        kr, ko = Kernels(ref_m, mod, ref_fns), Kernels(our_m, mod, our_fns)
        if dtype == torch.bfloat16:
            print(f"{name}: {ko.count} kernel references patched" + (" (module globals)" if ko.globals else ""))
        ref = run_model(ref_m, kr, ids.to(dev), args.tokens)
        ours = run_model(our_m, ko, ids.to(dev), args.tokens)
        del ref_m, our_m
        er, eo = rel_l2(ref[0], gold[0]), rel_l2(ours[0], gold[0])
        print(f"{tag}: logits rel L2 to the float64 gold: torch {er:.2e}, dgps {eo:.2e} (limit {limit(er):.2e}); "
              f"forward torch {ref[3]:.1f} ms, dgps {ours[3]:.1f} ms")
        if not eo <= limit(er):
            failed.append(f"{tag} logits")
        pr, po = prefix(ref[1], gold[1]), prefix(ours[1], gold[1])
        print(f"{tag}: greedy {len(ours[1])} tokens, prefix equal to the gold: torch {pr}, dgps {po}; "
              f"dgps equal to torch: {ours[1] == ref[1]}" + (" (reported)" if dtype == torch.bfloat16 else ""))
        if dtype != torch.bfloat16 and ours[1] != ref[1]:
            failed.append(f"{tag} greedy")
        rows = [(rel_l2(ours[2][n], gold[2][n]), rel_l2(ref[2][n], gold[2][n]), n) for n in gold[2]]
        worst = max((o - limit(r), o, r, n) for o, r, n in rows)
        largest = max(rows)
        print(f"{tag}: {len(rows)} gradients; worst against its limit: {worst[3]} dgps {worst[1]:.2e}, torch "
              f"{worst[2]:.2e}; largest dgps error {largest[0]:.2e} ({largest[2]})")
        if set(ours[2]) != set(gold[2]) or worst[0] > 0:
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
