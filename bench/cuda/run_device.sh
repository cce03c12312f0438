#!/usr/bin/env bash
# @brief One device call: GPU tests, compute-sanitizer, dgps benchmark and FLA benchmark, build-free.
#
# Runs on the H200 from the repository root with the binaries carried in .device/ (built here with
# build-cuda and copied there) and FLA's `fla` package in .fetch/fla-src (never part of dgps).
# Usage: bench/cuda/run_device.sh [tests|sanitize|bench|fla|all|ab|profile] [FLA filter, e.g. gdn,pgdn,decode,bwd]
# (default: all, every FLA case); DGPS_ONLY=pgdn limits dgps's forward cases the same way.
# `ab` compares changes with a baseline side by side: the binaries named by AB_VARIANTS (default
# "new base": .device/dgps_bench_cuda, then .device/dgps_bench_cuda_NAME for every other name; the last
# is the baseline, a build of the tree's head: a binary built from other code can differ by a few
# percent from code generation alone), AB_ROUNDS (default 2) rounds alternating them, then the kernels'
# durations under ncu (real clocks) for the models in AB_PROFILE (default pgdn).
# `profile` runs ncu's full set on one kernel (PROFILE_KERNEL, default intra_kernel: its first launch,
# at B=8 T=2048 H=16) of each model in PROFILE_MODELS (default gdn pgdn pkda) and keeps the details
# page, the per-SASS-line source counters (gzipped CSV) and their summary by bench/cuda/ncu_phases.py.
# Binaries may travel xz-compressed (.device/NAME.xz: three of them exceed the 64 MiB a call carries).
# Results go to $OUT (or ./.device/out): test log, bench CSVs and the joined markdown table.
set -u
what=${1:-all}
only=${2:-}
out=${OUT:-.device/out}
mkdir -p "$out"
export DGPS_TEST_DATA_DIR=$PWD/tests/data
export LD_LIBRARY_PATH=.device${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# (the device keeps ignored files between calls: a binary left by an earlier call is replaced when the
# carried .xz is newer)
for z in .device/*.xz; do
  [[ -f $z && (! -f ${z%.xz} || $z -nt ${z%.xz}) ]] && xz -dkf "$z" && chmod +x "${z%.xz}"
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader || true
if [[ $what == all || $what == tests ]]; then
  .device/dgps_cuda_tests 2>&1 | tee "$out/tests.log" | grep -v '^ok ' || true
  echo "tests rc=${PIPESTATUS[0]}"
fi
if [[ $what == all || $what == bench ]]; then
  .device/dgps_bench_cuda "$out/dgps_bench.csv" "${DGPS_ONLY:-}"
fi
if [[ $what == all || $what == fla ]]; then
  # Triton's compile and autotune cache travels between calls as .device/triton_cache.tgz.
  export TRITON_CACHE_DIR=/tmp/triton-cache FLA_CACHE_RESULTS=1
  mkdir -p $TRITON_CACHE_DIR
  [[ -f .device/triton_cache.tgz ]] && tar xzf .device/triton_cache.tgz -C $TRITON_CACHE_DIR
  PYTHONUNBUFFERED=1 timeout ${FLA_TIMEOUT:-280} env PYTHONPATH=.fetch/fla-src python3 bench/cuda/fla_bench.py "$out/fla_bench.csv" "$only" 2>&1 |
    grep -v Warning
  tar czf "$out/triton_cache.tgz" -C $TRITON_CACHE_DIR . 2>/dev/null
fi
if [[ $what == all || $what == sanitize ]]; then
  for tool in memcheck racecheck; do
    timeout 240 compute-sanitizer --tool $tool --error-exitcode 3 .device/dgps_cuda_tests --quick > "$out/sanitize_$tool.log" 2>&1
    echo "compute-sanitizer $tool rc=$? ($(grep -c '^ok ' "$out/sanitize_$tool.log") checks ok)"
    grep -E "ERROR SUMMARY|FAIL|Invalid|Race" "$out/sanitize_$tool.log" | head -5
  done
fi
if [[ $what == ab ]]; then
  variants=${AB_VARIANTS:-new base}  # names without '_'; 'new' is .device/dgps_bench_cuda
  vbin() { if [[ $1 == new ]]; then echo .device/dgps_bench_cuda; else echo ".device/dgps_bench_cuda_$1"; fi; }
  rm -f "$out"/ab_*.csv  # an earlier run's rounds would join the medians
  for ((r = 1; r <= ${AB_ROUNDS:-2}; ++r)); do
    for v in $variants; do
      "$(vbin "$v")" "$out/ab_${r}_$v.csv" "${DGPS_ONLY:-}" > /dev/null
    done
  done
  # model, case, then each variant's ms per round and the ratio of its median to the baseline's (the last
  # variant) (the CSV files' columns: impl,model,case,B,T,HV,ms,...)
  awk -F, -v vars="$variants" \
     'BEGIN {nv = split(vars, V, " ")}
      FNR == 1 {b = FILENAME; sub(/.*\//, "", b); split(b, f, "_"); v = f[3]; sub(/\.csv$/, "", v); next}
      $1 !~ /recurrent/ {k = $2 " " $3; if (!(k in seen)) {seen[k] = 1; order[++n] = k}
                         ms[k, v] = ms[k, v] " " $7; c[k, v]++; s[k, v, c[k, v]] = $7}
      function med(k, v,   i, j, a, m, t) {m = c[k, v]; for (i = 1; i <= m; ++i) a[i] = s[k, v, i]
        for (i = 1; i <= m; ++i) for (j = i + 1; j <= m; ++j) if (a[j] < a[i]) {t = a[i]; a[i] = a[j]; a[j] = t}
        return m % 2 ? a[(m + 1) / 2] : (a[m / 2] + a[m / 2 + 1]) / 2}
      END {h = "| model case |"; d = "|---|"
           for (j = 1; j <= nv; ++j) {h = h " " V[j] " ms |"; d = d "---|"}
           for (j = 1; j < nv; ++j) {h = h " " V[j] " / " V[nv] " |"; d = d "---|"}
           print h; print d
           for (i = 1; i <= n; ++i) {k = order[i]; line = "| " k " |"
             for (j = 1; j <= nv; ++j) line = line ms[k, V[j]] " |"
             b = c[k, V[nv]] ? med(k, V[nv]) : 0
             for (j = 1; j < nv; ++j)
               line = line " " (b > 0 && c[k, V[j]] ? sprintf("%.3f", med(k, V[j]) / b) : "-") " |"
             print line}}' \
    $(for v in $variants; do echo "$out"/ab_*_"$v".csv; done) | tee "$out/ab.md"
  if command -v ncu > /dev/null; then
    for m in ${AB_PROFILE:-pgdn}; do
      for v in $variants; do
        echo "== $m $v (ncu)"
        ncu --clock-control none --metrics gpu__time_duration.sum "$(vbin "$v")" --profile "$m" 2>&1 |
          awk '/^  [a-z_].*\(/ {n = $0; sub(/\(.*/, "", n); sub(/.*::/, "", n); sub(/<.*/, "", n)}
               /gpu__time_duration/ && n !~ /fill/ {printf "%s %s %s | ", n, $NF, $(NF - 1)} END {print ""}'
      done
    done
  fi
fi
if [[ $what == profile ]]; then
  for m in ${PROFILE_MODELS:-gdn pgdn pkda}; do
    echo "== profile $m"
    timeout 200 ncu --set full --import-source no -k "regex:${PROFILE_KERNEL:-intra_kernel}" --launch-count 1 \
      -o "$out/$m" .device/dgps_bench_cuda --profile "$m" > /dev/null 2>&1
    ncu --import "$out/$m.ncu-rep" --page details > "$out/$m.details.txt" 2>&1
    ncu --import "$out/$m.ncu-rep" --page source --csv --print-source sass > "$out/$m.source.csv" 2>&1
    grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Warp Cycles Per Issued" "$out/$m.details.txt"
    python3 bench/cuda/ncu_phases.py "$out/$m.source.csv" | tee "$out/$m.phases.md"
    gzip -f "$out/$m.source.csv"
    rm -f "$out/$m.ncu-rep"
  done
fi
if [[ -f $out/dgps_bench.csv ]]; then
  python3 bench/cuda/combine.py "$out/dgps_bench.csv" "$out/fla_bench.csv" | tee "$out/table.md"
fi
