"""@brief Joins bench_cuda's CSV and one or more fla_bench.py CSVs into a markdown table with dgps/FLA ratios.

Rows join on (model, case): forward (`fwd_*`), forward + backward (`fwdbwd_*`), backward alone (`bwd_*`)
and decode rows. A second table compares the memory of the backward rows: dgps's backward workspace
(bench_cuda's `mem_bytes`) and FLA's peak allocation during forward + backward (fla_bench's `mem_bytes`).
`--grid dgps.csv [fla.csv]`: the plan grid's table (bench_cuda --grid, fla_bench.py --grid).
"""
import csv
import sys


def mib(x):
    """Bytes as MiB with one decimal, or 'n/a' when absent."""
    return f"{float(x) / 2**20:.1f}" if x else "n/a"


def main(dgps_csv, *fla_csvs):
    """Prints the joined timing table and, for the backward rows, the memory table."""
    fla, fla_mem = {}, {}
    for path in fla_csvs:  # later files override earlier ones
        try:
            for r in csv.DictReader(open(path)):
                fla[(r["model"], r["case"])] = float(r["ms"])
                if r.get("mem_bytes"):
                    fla_mem[(r["model"], r["case"])] = r["mem_bytes"]
        except FileNotFoundError:
            pass
    rows = list(csv.DictReader(open(dgps_csv)))
    print("| model | case | dgps ms | FLA ms | dgps/FLA time | tokens/s | TFLOP/s (6KV/token fwd, 12KV bwd) | GB/s | "
          "% copy BW | dgps variant |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms = float(r["ms"])
        s = ms * 1e-3
        bw = float(r["bytes"]) / s / 1e9
        f = fla.get((r["model"], r["case"]))
        tokens = int(r["B"]) * int(r["T"])
        print(f"| {r['model']} | {r['case']} | {ms:.4f} | {f'{f:.4f}' if f else 'n/a'} | "
              f"{f'{ms / f:.2f}' if f else 'n/a'} | {tokens / s:.3g} | {float(r['flops']) / s / 1e12:.2f} | "
              f"{bw:.0f} | {100 * bw / float(r['copy_gbps']):.1f} | {r['variant']} |")
    mem = [r for r in rows if r["case"].startswith("fwdbwd_") and r.get("mem_bytes")]
    if mem:
        print()
        print("| model | case | dgps backward workspace MiB | FLA fwd+bwd peak allocation MiB (above the inputs) |")
        print("|---|---|---|---|")
        for r in mem:
            f = fla_mem.get((r["model"], r["case"]))
            print(f"| {r['model']} | {r['case']} | {mib(r['mem_bytes'])} | {mib(f)} |")


def grid(dgps_csv, fla_csv):
    """The plan grid: bench_cuda --grid's rows (every variant) beside fla_bench.py --grid's (FLA with and
    without CUDA graphs). One row per point: dgps's automatic plan, its best forced variant, FLA, the ratios,
    ns per token-head and the fraction of the bytes floor."""
    fla = {}
    try:
        for r in csv.DictReader(open(fla_csv)):
            try:
                fla[(r["model"], r["layout"], r["hqk"], r["hv"])] = (float(r["ms_graph"]), float(r["ms_eager"]))
            except ValueError:  # an FLA error row
                pass
    except (FileNotFoundError, TypeError):
        pass
    points = {}
    for r in csv.DictReader(open(dgps_csv)):
        points.setdefault((r["model"], r["layout"], r["hqk"], r["hv"]), []).append(r)
    print("| model | layout | h_qk/h_v | dgps ms | ns/token-head | floor frac | best forced variant (ms) | auto/best | "
          "FLA graph ms | FLA eager ms | dgps/FLA graph |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for key, rs in points.items():
        auto = next((r for r in rs if r["variant"] == "auto"), None)
        if auto is None:
            continue
        best = min(rs, key=lambda r: float(r["ms"]))
        a = float(auto["ms"])
        f = fla.get(key)
        print(f"| {key[0]} | {key[1]} | {key[2]}/{key[3]} | {a:.4f} | {float(auto['ns_per_token_head']):.3f} | "
              f"{float(auto['floor_frac']):.2f} | {best['variant']} ({float(best['ms']):.4f}) | "
              f"{a / float(best['ms']):.2f} | {f'{f[0]:.4f}' if f else 'n/a'} | {f'{f[1]:.4f}' if f else 'n/a'} | "
              f"{f'{a / f[0]:.2f}' if f else 'n/a'} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--grid":  # --grid dgps_grid.csv [fla_grid.csv]
        grid(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
    else:
        main(sys.argv[1], *sys.argv[2:])
