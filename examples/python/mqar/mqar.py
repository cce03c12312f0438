"""Train the two-layer MQAR model (DN, PDN, GDN or PGDN) over a learning-rate sweep; see docs/mqar.md.

  python3 mqar.py --model gdn --kernel dgps --seq-len 64 --kv-pairs 8 --batch 32 --steps 1000 --lrs 1e-2
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data import IGNORE, VOCAB, MQARStream  # noqa: E402
from kernels import MODELS, get_kernel  # noqa: E402
from model import MQARModel  # noqa: E402


def add_args(p):
    """The training options shared by mqar.py and study.py."""
    p.add_argument("--kernel", default="dgps", choices=("dgps", "fla", "torch"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="activation dtype (bfloat16 through autocast); the recurrence state is float32")
    p.add_argument("--lrs", default="1e-2", help="comma-separated learning rates (the sweep)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--expand-v", type=float, default=1.0)
    p.add_argument("--mlp-expand", type=float, default=2.0)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=float, default=0.1, help="fraction of the steps spent warming up")
    p.add_argument("--final-lr", type=float, default=0.1,
                   help="the cosine decay's end, as a fraction of the peak (1: constant after the warmup)")
    p.add_argument("--test-size", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--fla-hopper-gated-backward", action="store_true",
                   help="--kernel fla on Hopper with Triton < 3.7.1: run FLA's gated backward, which FLA refuses "
                        "there because that Triton computes wrong gradients (FLA issue #640)")
    return p


def parse_lrs(s):
    return [float(x) for x in str(s).split(",") if x.strip()]


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _autocast(cfg):
    return torch.autocast(device_type=cfg.device, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16")


def build(cfg, model_name, kernel_name=None):
    """The model for `model_name` on cfg.device, its recurrence from `kernel_name` (default cfg.kernel)."""
    kernel = get_kernel(kernel_name or cfg.kernel, cfg.fla_hopper_gated_backward)
    m = MQARModel(model_name, cfg.vocab, cfg.d_model, cfg.heads, kernel, mlp_expand=cfg.mlp_expand,
                  expand_v=cfg.expand_v, seed=cfg.seed)
    return m.to(cfg.device)


@torch.no_grad()
def evaluate(model, cfg, test, chunk=250):
    """(loss, accuracy) over the query positions of the test set."""
    model.eval()
    inputs, targets = test
    total_loss, correct, count = 0.0, 0, 0
    for i in range(0, inputs.shape[0], chunk):
        x = inputs[i:i + chunk].to(cfg.device)
        y = targets[i:i + chunk].to(cfg.device)
        with _autocast(cfg):
            logits, yq = model(x, y, IGNORE)
        logits = logits.float()
        total_loss += F.cross_entropy(logits, yq, reduction="sum").item()
        correct += (logits.argmax(-1) == yq).sum().item()
        count += yq.numel()
    model.train()
    return total_loss / count, correct / count


def _optimizer(model, cfg, lr):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98))


def _lr_at(step, cfg, lr):
    """Linear warmup, then cosine decay to cfg.final_lr of the peak."""
    warm = max(1, int(cfg.warmup * cfg.steps))
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return lr * (cfg.final_lr + (1 - cfg.final_lr) * 0.5 * (1 + math.cos(math.pi * t)))


def train(cfg, model_name, lr, kernel_name=None, log=print, tag=""):
    """Trains one model at one learning rate; returns a dict of its history and results."""
    kernel_name = kernel_name or cfg.kernel
    torch.manual_seed(cfg.seed)
    data = MQARStream(cfg.seq_len, cfg.kv_pairs, cfg.batch, cfg.test_size, seed=cfg.seed, vocab=cfg.vocab)
    model = build(cfg, model_name, kernel_name)
    opt = _optimizer(model, cfg, lr)
    params = sum(p.numel() for p in model.parameters())
    log(f"{tag}{model_name} kernel={kernel_name} lr={lr:g} T={cfg.seq_len} kv={cfg.kv_pairs} d={cfg.d_model} "
        f"heads={cfg.heads} batch={cfg.batch} steps={cfg.steps} dtype={cfg.dtype} params={params}")
    losses, evals = [], []
    run_loss, run_correct, run_count = 0.0, 0, 0
    best_acc, diverged = 0.0, False
    start = time.time()
    step_times = []
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg, lr)
        x, y = (t.to(cfg.device) for t in data.next())
        _sync(cfg.device)
        t0 = time.time()
        with _autocast(cfg):
            logits, yq = model(x, y, IGNORE)
        loss = F.cross_entropy(logits.float(), yq)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = loss.item()  # also synchronises the device for the step time
        step_times.append(time.time() - t0)
        losses.append(lv)
        if not math.isfinite(lv):
            log(f"{tag}  step {step + 1}: loss is {lv}, stopping this learning rate")
            diverged = True
            break
        run_loss += lv * yq.numel()
        run_correct += (logits.detach().argmax(-1) == yq).sum().item()
        run_count += yq.numel()
        last = step + 1 == cfg.steps
        if (step + 1) % cfg.eval_every == 0 or last:
            ev_loss, ev_acc = evaluate(model, cfg, data.test)
            best_acc = max(best_acc, ev_acc)
            evals.append((step + 1, ev_loss, ev_acc))
        if (step + 1) % cfg.log_every == 0 or last:
            ev = f" | test loss {evals[-1][1]:.3f} acc {evals[-1][2]:.3f}" if evals and evals[-1][0] == step + 1 else ""
            log(f"{tag}  step {step + 1:5d}/{cfg.steps} lr {opt.param_groups[0]['lr']:.2e} "
                f"loss {run_loss / run_count:.3f} acc {run_correct / run_count:.3f}{ev} ({time.time() - start:.0f} s)")
            run_loss, run_correct, run_count = 0.0, 0, 0
    wall = time.time() - start
    steady = step_times[min(5, len(step_times) - 1):] if step_times else [0.0]
    final_acc = evals[-1][2] if evals and not diverged else 0.0
    return {"model": model_name, "kernel": kernel_name, "lr": lr, "seq_len": cfg.seq_len, "kv_pairs": cfg.kv_pairs,
            "final_acc": final_acc, "best_acc": 0.0 if diverged else best_acc, "diverged": diverged,
            "wall_s": wall, "step_s": sum(steady) / len(steady), "losses": losses, "evals": evals, "params": params}


def sweep(cfg, model_name, lrs, kernel_name=None, log=print, tag=""):
    """Trains at every learning rate; returns (best result by final test accuracy, all results)."""
    results = [train(cfg, model_name, lr, kernel_name, log, tag) for lr in lrs]
    best = max(results, key=lambda r: (r["final_acc"], r["best_acc"]))
    return best, results


def main(argv=None):
    p = add_args(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--model", default="gdn", choices=MODELS)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--kv-pairs", type=int, default=8)
    p.add_argument("--json", help="write the results (with loss histories) to this file")
    cfg = p.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress lines appear when piped to a file
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    start = time.time()
    best, results = sweep(cfg, cfg.model, parse_lrs(cfg.lrs))
    for r in results:
        print(f"lr {r['lr']:g}: final acc {r['final_acc']:.4f} best {r['best_acc']:.4f} "
              f"({r['wall_s']:.0f} s, {1e3 * r['step_s']:.1f} ms/step)")
    print(f"best: {cfg.model} lr {best['lr']:g} accuracy {best['final_acc']:.4f}; total wall time "
          f"{time.time() - start:.0f} s")
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(results, f)
    return 1 if all(r["diverged"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
