#!/usr/bin/env bash
# @brief CI stage for dgps_torch: installs Debian's PyTorch, builds the package against it, runs its pytest suite.
#
# Usage: python/ci.sh [work dir]   (run from anywhere; needs apt-get as root, or the packages already installed)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="${1:-${TMPDIR:-/tmp}/dgps_torch_ci}"
py=/usr/bin/python3  # Debian's python3-torch lives in /usr/lib/python3/dist-packages
start=$(date +%s)

need=()
for p in python3-torch libtorch-dev python3-pytest python3-numpy python3-pip python3-setuptools python3-wheel libopenblas0-pthread cmake ninja-build; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if ((${#need[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

mkdir -p "$work"
work="$(cd "$work" && pwd)"  # absolute: the tests run from inside it
rm -rf "$work/site"
export DGPS_TORCH_BUILD_DIR="$work/build" DGPS_TORCH_CUDA="${DGPS_TORCH_CUDA:-0}"
"$py" -m pip install --no-build-isolation --no-deps --quiet --target "$work/site" "$here"
echo "dgps_torch: built in $(($(date +%s) - start)) s"
cd "$work"
PYTHONPATH="$work/site" "$py" -m pytest -q -p no:cacheprovider "$here/tests"
echo "dgps_torch: stage done in $(($(date +%s) - start)) s"
