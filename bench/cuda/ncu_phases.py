#!/usr/bin/env python3
"""Summarises one kernel's ncu source counters (`ncu --import R --page source --csv --print-source sass`).

Usage: ncu_phases.py SOURCE.csv[.gz] [--top N]

Prints the warp instructions executed and the stall samples, the stall reasons' shares, then the
kernel cut into phases at its block barriers (BAR.SYNC / BAR.RED in SASS order): each phase's share of
the stall samples and of the executed instructions, its closing barrier's executions (counted per warp), and
its most frequent opcodes, so that a phase can be matched to the source; last, the N SASS lines with
the most samples and their main stall reason. Phases that neither execute nor stall are left out.
"""
import collections
import csv
import gzip
import sys


def opcode(src):
    words = src.split()
    if not words:
        return ""
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def main(argv):
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    path = argv[1]
    top = int(argv[argv.index("--top") + 1]) if "--top" in argv else 20
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        rows = list(csv.reader(f))
    # Row 0 names the kernel; row 1 is the header.
    kernel, header, data = rows[0], rows[1], [r for r in rows[2:] if len(r) == len(rows[1])]
    col = {h: i for i, h in enumerate(header)}
    samples_col = col["Warp Stall Sampling (All Samples)"]
    instr_col = col["Instructions Executed"]
    stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]

    def num(r, c):
        try:
            return int(r[c] or 0)
        except ValueError:
            return 0

    samples = [num(r, samples_col) for r in data]
    instr = [num(r, instr_col) for r in data]
    total_s, total_i = max(sum(samples), 1), max(sum(instr), 1)
    print(" ".join(x for x in kernel if x))
    print(f"warp instructions executed {sum(instr)}, stall samples {sum(samples)}")
    reasons = collections.Counter()
    for r in data:
        for h in stall_cols:
            reasons[h[6:]] += num(r, col[h])
    print("stalls: " + ", ".join(f"{k} {v * 100 / total_s:.1f}%" for k, v in reasons.most_common(8)))

    print("\n| phase (SASS lines) | closing barrier executed (warps) | samples | instructions | main opcodes |")
    print("|---|---|---|---|---|")
    start = 0
    for i, r in enumerate(data + [None]):
        is_end = r is None or opcode(r[col["Source"]].strip()).startswith(("BAR.SYNC", "BAR.RED"))
        if not is_end:
            continue
        end = len(data) if r is None else i + 1
        s, n = sum(samples[start:end]), sum(instr[start:end])
        if s or n:
            ops = collections.Counter()
            for j in range(start, end):
                ops[opcode(data[j][col["Source"]].strip())] += instr[j]
            runs = "end" if r is None else str(instr[i])
            main_ops = ", ".join(k for k, _ in ops.most_common(4))
            print(f"| {start}-{end - 1} | {runs} | {s * 100 / total_s:.1f}% | {n * 100 / total_i:.1f}% | {main_ops} |")
        start = end

    print(f"\nthe {top} lines with the most samples:")
    for i in sorted(sorted(range(len(data)), key=lambda i: -samples[i])[:top]):
        r = data[i]
        why = max(stall_cols, key=lambda h: num(r, col[h]))[6:] if stall_cols else ""
        print(f"{i:6d} {samples[i] * 100 / total_s:5.1f}% {why:18s} {r[col['Source']].strip()[:80]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
