"""The paper's MQAR study (Fig. 5) and a kernel comparison, on top of mqar.py; see docs/mqar.md.

  grid:    DN, PDN, GDN, PGDN; slice A (64 KV pairs) and slice B (KV : length = 1 : 8) at each length;
           each point the best of the learning-rate sweep. Writes results.csv (every run), table.md, fig5.png.
  compare: one model trained with two kernels from the same seed; writes the loss curves (CSV, PNG), their
           difference, and the training step's time with the mixer recurrence's share.
"""
import argparse
import csv
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import MODELS, get_kernel  # noqa: E402
from mqar import _sync, add_args, parse_lrs, sweep, train  # noqa: E402

LABEL = {"dn": "DN", "pdn": "PDN", "gdn": "GDN", "pgdn": "PGDN"}
CSV_HEADER = ["model", "seq_len", "kv_pairs", "lr", "final_acc", "best_acc", "diverged", "wall_s", "step_ms"]
STYLE = {"dn": ("tab:blue", "--"), "pdn": ("tab:blue", "-"), "gdn": ("tab:red", "--"), "pgdn": ("tab:red", "-")}


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def _points(lengths, slices, kv_fixed, kv_ratio):
    """[(slice, length, kv_pairs)] for slice A (kv_fixed pairs) and slice B (length / kv_ratio pairs)."""
    pts = []
    for s in slices:
        for L in lengths:
            pts.append((s, L, kv_fixed if s == "A" else L // kv_ratio))
    return pts


def _grid_points(cfg):
    return _points([int(x) for x in cfg.lengths.split(",")], cfg.slices.split(","), cfg.kv_fixed, cfg.kv_ratio)


def run_grid(cfg, log, argv=()):
    os.makedirs(cfg.out, exist_ok=True)
    models = cfg.models.split(",")
    if cfg.jobs > 1 and len(models) > 1:
        return _grid_parallel(cfg, log, models, argv)
    lrs = parse_lrs(cfg.lrs)
    pts = _grid_points(cfg)
    runs_path = os.path.join(cfg.out, "results.csv")
    done = set()  # slices A and B share a point where length = kv_fixed * kv_ratio
    with open(runs_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_HEADER)
        for model in models:
            for s, L, kv in pts:
                if (model, L, kv) in done:
                    continue
                done.add((model, L, kv))
                cfg.seq_len, cfg.kv_pairs = L, kv
                best, results = sweep(cfg, model, lrs, log=log, tag=f"[{LABEL[model]} T={L} kv={kv}] ")
                for r in results:
                    w.writerow([model, L, kv, r["lr"], f"{r['final_acc']:.4f}", f"{r['best_acc']:.4f}",
                                int(r["diverged"]), f"{r['wall_s']:.1f}", f"{1e3 * r['step_s']:.2f}"])
                f.flush()
                log(f"[{LABEL[model]} T={L} kv={kv}] best lr {best['lr']:g}: accuracy {best['final_acc']:.4f}")
    return report(cfg, [runs_path])


def _grid_parallel(cfg, log, models, argv):
    """One process per model (the GPU is far from busy with one small model); merges their results.csv.

    Processes still running after --deadline seconds are stopped; the points they finished are reported."""
    import subprocess
    procs = []
    for m in models:
        out = os.path.join(cfg.out, m)
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--models", m, "--out", out, "--jobs", "1"]
        procs.append((m, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)))
        log(f"grid: {LABEL[m]} in its own process, log in {os.path.join(out, 'grid.log')}")
    t0 = time.time()
    for m, proc in procs:
        try:
            proc.wait(timeout=None if not cfg.deadline else max(1.0, cfg.deadline - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            log(f"grid: {LABEL[m]} stopped at the deadline ({cfg.deadline:g} s); its finished points are kept")
    return report(cfg, [os.path.join(cfg.out, m, "results.csv") for m in models])


def report(cfg, paths):
    """Table, figure and grid.json from results.csv files: each point the best of its learning rates."""
    runs = []
    for path in paths:
        if os.path.exists(path):
            with open(path, newline="") as f:
                runs += list(csv.DictReader(f))
    models = [m for m in MODELS if any(r["model"] == m for r in runs)]
    lrs = sorted({float(r["lr"]) for r in runs})
    pts = _grid_points(cfg)
    rows = []
    for model in models:
        for s, L, kv in pts:
            mine = [r for r in runs if r["model"] == model and int(r["seq_len"]) == L and int(r["kv_pairs"]) == kv]
            if not mine:
                continue
            best = max(mine, key=lambda r: (float(r["final_acc"]), float(r["best_acc"])))
            rows.append({"slice": s, "model": model, "seq_len": L, "kv_pairs": kv, "acc": float(best["final_acc"]),
                         "lr": float(best["lr"]), "wall_s": sum(float(r["wall_s"]) for r in mine),
                         "step_ms": float(best["step_ms"])})
    _write_table(cfg, rows, models, lrs)
    _plot_grid(cfg, rows, models)
    with open(os.path.join(cfg.out, "grid.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


def _write_table(cfg, rows, models, lrs):
    path = os.path.join(cfg.out, "table.md")
    with open(path, "w") as f:
        f.write(f"MQAR accuracy (best of learning rates {', '.join(f'{x:g}' for x in lrs)}; kernel {cfg.kernel}, "
                f"{cfg.dtype}, d_model {cfg.d_model}, heads {cfg.heads}, {cfg.steps} steps of batch {cfg.batch}, "
                f"seed {cfg.seed})\n\n")
        f.write("| slice | length | KV pairs | " + " | ".join(LABEL[m] for m in models) + " | wall time per point |\n")
        f.write("|---|---|---|" + "---|" * len(models) + "---|\n")
        seen = []
        for r in rows:
            pt = (r["slice"], r["seq_len"], r["kv_pairs"])
            if pt in seen:
                continue
            seen.append(pt)
            cells = [r2 for r2 in rows if (r2["slice"], r2["seq_len"], r2["kv_pairs"]) == pt]
            by = {c["model"]: c for c in cells}
            accs = " | ".join(f"{by[m]['acc']:.3f} (lr {by[m]['lr']:g})" if m in by else "" for m in models)
            walls = ", ".join(f"{LABEL[m]} {by[m]['wall_s']:.0f} s" for m in models if m in by)
            f.write(f"| {pt[0]} | {pt[1]} | {pt[2]} | {accs} | {walls} |\n")
    print(f"wrote {path}")


def _plot_grid(cfg, rows, models):
    plt = _pyplot()
    if plt is None:
        print("matplotlib is not installed: no plot (the table and CSV are written)")
        return
    slices = sorted({r["slice"] for r in rows})
    fig, axes = plt.subplots(1, len(slices), figsize=(5 * len(slices), 3.8), squeeze=False)
    titles = {"A": f"{cfg.kv_fixed} KV pairs", "B": f"KV pairs = length / {cfg.kv_ratio}"}
    for ax, s in zip(axes[0], slices):
        for m in models:
            pts = sorted((r["seq_len"], r["acc"]) for r in rows if r["slice"] == s and r["model"] == m)
            if pts:
                color, ls = STYLE[m]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, marker="o", color=color, label=LABEL[m])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("MQAR accuracy")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"slice {s}: {titles[s]}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = os.path.join(cfg.out, "fig5.png")
    fig.savefig(path, dpi=130)
    print(f"wrote {path}")


def time_mixer(cfg, model_name, kernel_name, shapes, iters=10):
    """Seconds for one forward + backward of the recurrence alone at the model's shapes."""
    (B, T, H, K), (_, _, _, V), dtype = shapes
    run = get_kernel(kernel_name, cfg.fla_hopper_gated_backward)
    gen = torch.Generator().manual_seed(cfg.seed)

    def rnd(*s, dt=dtype):
        return torch.randn(*s, generator=gen).to(device=cfg.device, dtype=dt).requires_grad_()

    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)
    beta = torch.rand(B, T, H, generator=gen).to(device=cfg.device, dtype=dtype).requires_grad_()
    g = (-0.1 * torch.rand(B, T, H, generator=gen)).to(cfg.device).requires_grad_()
    g_atk = (-0.1 * torch.rand(B, T, H, generator=gen)).to(cfg.device).requires_grad_()
    beta_atk = torch.rand(B, T, H, generator=gen).to(cfg.device).requires_grad_()
    center = torch.full((H,), -0.2, device=cfg.device, requires_grad=True)
    do = torch.randn(B, T, H, V, generator=gen).to(device=cfg.device, dtype=dtype)

    def once():
        o = run(model_name, q, k, v, beta, g=g, g_atk=g_atk, beta_atk=beta_atk, center=center)
        o.backward(do)

    for _ in range(3):
        once()
    _sync(cfg.device)
    t0 = time.time()
    for _ in range(iters):
        once()
    _sync(cfg.device)
    return (time.time() - t0) / iters


def run_compare(cfg, log):
    os.makedirs(cfg.out, exist_ok=True)
    kernels = cfg.kernels.split(",")
    if len(kernels) != 2:
        raise SystemExit("study.py compare: --kernels takes two names, e.g. dgps,fla")
    lr = parse_lrs(cfg.lrs)[0]
    summary = []
    for model in cfg.models.split(","):
        res = {}
        for kern in kernels:
            res[kern] = train(cfg, model, lr, kern, log=log, tag=f"[{LABEL[model]} {kern}] ")
        a, b = (res[k]["losses"] for k in kernels)
        n = min(len(a), len(b))
        diffs = [abs(x - y) for x, y in zip(a[:n], b[:n])]
        rel = [d / max(abs(x), 1e-6) for d, x in zip(diffs, a[:n])]
        curves = os.path.join(cfg.out, f"curves_{model}.csv")
        with open(curves, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", f"loss_{kernels[0]}", f"loss_{kernels[1]}"])
            for i in range(n):
                w.writerow([i + 1, f"{a[i]:.6f}", f"{b[i]:.6f}"])
        shapes = _mixer_shapes(cfg)
        row = {"model": model, "steps": n, "max_abs_diff": max(diffs), "max_rel_diff": max(rel),
               "mean_abs_diff": sum(diffs) / n}
        for kern in kernels:
            mix = time_mixer(cfg, model, kern, shapes) * 2  # two mixer layers
            row[f"step_ms_{kern}"] = 1e3 * res[kern]["step_s"]
            row[f"mixer_ms_{kern}"] = 1e3 * mix
            row[f"acc_{kern}"] = res[kern]["final_acc"]
        summary.append(row)
        log(f"[{LABEL[model]}] loss curves over {n} steps: max |diff| {row['max_abs_diff']:.4g} "
            f"(relative {row['max_rel_diff']:.3g}), mean |diff| {row['mean_abs_diff']:.4g}")
        for kern in kernels:
            log(f"[{LABEL[model]}] {kern}: step {row[f'step_ms_{kern}']:.2f} ms, mixer (2 layers, fwd+bwd, alone) "
                f"{row[f'mixer_ms_{kern}']:.2f} ms = {row[f'mixer_ms_{kern}'] / row[f'step_ms_{kern}']:.0%} of the "
                f"step, final accuracy {row[f'acc_{kern}']:.4f}")
        _plot_curves(cfg, model, kernels, a[:n], b[:n])
    with open(os.path.join(cfg.out, "compare.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def _mixer_shapes(cfg):
    """The recurrence's input shapes at this configuration (as DeltaMixer forms them)."""
    K = cfg.d_model // cfg.heads
    V = int(K * cfg.expand_v)
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32  # autocast's output dtype
    return (cfg.batch, cfg.seq_len, cfg.heads, K), (cfg.batch, cfg.seq_len, cfg.heads, V), dtype


def _plot_curves(cfg, model, kernels, a, b):
    plt = _pyplot()
    if plt is None:
        return
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(6, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    steps = range(1, len(a) + 1)
    ax0.plot(steps, a, label=kernels[0], lw=1.2)
    ax0.plot(steps, b, "--", label=kernels[1], lw=1.2)
    ax0.set_ylabel("training loss")
    ax0.set_title(f"{LABEL[model]}, T={cfg.seq_len}, {cfg.kv_pairs} KV pairs, {cfg.dtype}, seed {cfg.seed}")
    ax0.legend()
    ax1.plot(steps, [x - y for x, y in zip(a, b)], lw=0.8, color="k")
    ax1.set_ylabel(f"{kernels[0]} - {kernels[1]}")
    ax1.set_xlabel("step")
    fig.tight_layout()
    path = os.path.join(cfg.out, f"curves_{model}.png")
    fig.savefig(path, dpi=130)
    print(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("grid", "compare", "report"))
    p.add_argument("--out", default="mqar_out")
    p.add_argument("--models", default="dn,pdn,gdn,pgdn")
    p.add_argument("--lengths", default="256,512,1024", help="grid: sequence lengths")
    p.add_argument("--slices", default="A,B")
    p.add_argument("--kv-fixed", type=int, default=64, help="grid slice A: KV pairs at every length")
    p.add_argument("--kv-ratio", type=int, default=8, help="grid slice B: KV pairs = length / ratio")
    p.add_argument("--jobs", type=int, default=1, help="grid: models trained at once, one process each")
    p.add_argument("--deadline", type=float, default=0, help="grid with --jobs: stop the processes after this "
                   "many seconds and report the points they finished (0: no limit)")
    p.add_argument("--kernels", default="dgps,fla", help="compare: the two kernels")
    p.add_argument("--seq-len", type=int, default=256, help="compare: sequence length")
    p.add_argument("--kv-pairs", type=int, default=32, help="compare: KV pairs")
    add_args(p)
    cfg = p.parse_args(argv)
    for m in cfg.models.split(","):
        if m not in MODELS:
            raise SystemExit(f"study.py: unknown model {m!r} ({', '.join(MODELS)})")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    os.makedirs(cfg.out, exist_ok=True)
    logf = open(os.path.join(cfg.out, f"{cfg.mode}.log"), "w")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    start = time.time()
    if cfg.mode == "grid":
        run_grid(cfg, log, argv=list(sys.argv[1:] if argv is None else argv))
    elif cfg.mode == "report":  # the table and figure again from <out>/results.csv and <out>/<model>/results.csv
        report(cfg, [os.path.join(cfg.out, "results.csv")] +
               [os.path.join(cfg.out, m, "results.csv") for m in cfg.models.split(",")])
    else:
        run_compare(cfg, log)
    log(f"study {cfg.mode}: done in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
