#!/usr/bin/env bash
# @brief One device call: GPU tests, compute-sanitizer, dgps benchmark and FLA benchmark, build-free.
#
# Runs on the H200 from the repository root with the binaries carried in .device/ (built here with
# build-cuda and copied there) and FLA's `fla` package in .fetch/fla-src (never part of dgps).
# Usage: bench/cuda/run_device.sh [tests|sanitize|bench|fla|all] [FLA filter, e.g. gdn,pgdn,decode,bwd]
# (default: all, every FLA case); DGPS_ONLY=pgdn limits dgps's forward cases the same way.
# Results go to $OUT (or ./.device/out): test log, bench CSVs and the joined markdown table.
set -u
what=${1:-all}
only=${2:-}
out=${OUT:-.device/out}
mkdir -p "$out"
export DGPS_TEST_DATA_DIR=$PWD/tests/data
export LD_LIBRARY_PATH=.device${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
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
if [[ -f $out/dgps_bench.csv ]]; then
  python3 bench/cuda/combine.py "$out/dgps_bench.csv" "$out/fla_bench.csv" | tee "$out/table.md"
fi
