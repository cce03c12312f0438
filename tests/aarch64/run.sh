#!/usr/bin/env bash
# @brief Cross-builds dgps_tests for aarch64 with GCC's cross compiler and runs it under qemu-user: the NEON64 unit of
# the CPU kernels (selected at run time; the first line of the test output names it) and, with
# DGPS_MAX_CPU_ISA=generic inside the suite, the plain-loop unit. One build tree, one target, no run-time registry
# (DGPS_TESTS_WITH_REGISTRY=OFF), no TBB (the std::thread fallback), no CUDA.
#
# Usage: tests/aarch64/run.sh [build-dir]   (default build-aarch64). Needs g++-aarch64-linux-gnu, qemu-user,
# cmake, ninja-build and the header-only libxsimd-dev, doctest-dev (libeigen3-dev optional).
# Environment: DGPS_AARCH64_JOBS (default 2) build jobs; extra arguments for dgps_tests in DGPS_AARCH64_TEST_ARGS.
set -euo pipefail

cd "$(dirname "$0")/../.."
build_dir=${1:-build-aarch64}
jobs=${DGPS_AARCH64_JOBS:-2}
sysroot=/usr/aarch64-linux-gnu
qemu=$(command -v qemu-aarch64 || command -v qemu-aarch64-static || true)
if [[ -z "${qemu}" ]]; then echo "tests/aarch64/run.sh: qemu-aarch64 not found (apt-get install qemu-user)" >&2; exit 1; fi

t0=$(date +%s)
cmake -S . -B "${build_dir}" -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/toolchains/aarch64-linux-gnu.cmake \
  -DCMAKE_BUILD_TYPE=Release -DDGPS_WARNINGS_AS_ERRORS=ON -DDGPS_WITH_TBB=OFF -DDGPS_WITH_CUDA=OFF \
  -DDGPS_TESTS_WITH_REGISTRY=OFF -DDGPS_BUILD_EXAMPLES=OFF -DDGPS_BUILD_BENCH=OFF
cmake --build "${build_dir}" --target dgps_tests -j"${jobs}"
t1=$(date +%s)

file "${build_dir}/tests/dgps_tests" 2>/dev/null || true
# shellcheck disable=SC2086
"${qemu}" -L "${sysroot}" "${build_dir}/tests/dgps_tests" ${DGPS_AARCH64_TEST_ARGS:-} 2>&1 | tee "${build_dir}/dgps_tests.log"
rc=${PIPESTATUS[0]}
t2=$(date +%s)
grep -q '^dgps_tests: CPU kernels neon64' "${build_dir}/dgps_tests.log" ||
  { echo "tests/aarch64/run.sh: the NEON64 kernels were not selected" >&2; rc=1; }
echo "aarch64: build $((t1 - t0)) s, tests under qemu $((t2 - t1)) s, exit ${rc}"
exit "${rc}"
