"""@brief Joins bench_cuda's CSV and one or more fla_bench.py CSVs into a markdown table with dgps/FLA ratios."""
import csv
import sys


def main(dgps_csv, *fla_csvs):
    fla = {}
    for path in fla_csvs:  # later files override earlier ones
        try:
            for r in csv.DictReader(open(path)):
                fla[(r["model"], r["case"])] = float(r["ms"])
        except FileNotFoundError:
            pass
    print("| model | case | dgps ms | FLA ms | dgps/FLA time | tokens/s | TFLOP/s (6KV/token) | GB/s | % copy BW | dgps variant |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in csv.DictReader(open(dgps_csv)):
        ms = float(r["ms"])
        s = ms * 1e-3
        bw = float(r["bytes"]) / s / 1e9
        f = fla.get((r["model"], r["case"]))
        tokens = int(r["B"]) * int(r["T"])
        print(f"| {r['model']} | {r['case']} | {ms:.4f} | {f'{f:.4f}' if f else 'n/a'} | "
              f"{f'{ms / f:.2f}' if f else 'n/a'} | {tokens / s:.3g} | {float(r['flops']) / s / 1e12:.2f} | "
              f"{bw:.0f} | {100 * bw / float(r['copy_gbps']):.1f} | {r['variant']} |")


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:])
