#!/usr/bin/env bash
# Every GPU-marked test plus the full conformance matrix, on a CUDA machine.
# Device tool: run with carry [".whl"]; logs land in $OUT (default ./gpu_out).
#   bash ci/gpu_tests.sh                 # everything but the 1920-case FlashMLA-compat grid
#   bash ci/gpu_tests.sh -k grid_gpu     # that grid alone (long)
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
source ci/gpu_setup.sh
set -o pipefail
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
python -m mla_dispatch build 2>&1 | tail -n 3
# xdist spreads the GPU grid over CPU workers (kernel compiles dominate); all share the one GPU.
PYTEST_ARGS=("$@"); [ ${#PYTEST_ARGS[@]} -eq 0 ] && PYTEST_ARGS=(-k "not grid_gpu")
# -v writes one line per finished test to the log, so failures stay identifiable even if a
# device-time limit kills the run before pytest's summary.
python -m pytest -v -rf -m gpu -n 8 -p no:cacheprovider "${PYTEST_ARGS[@]}" tests > "$OUT/pytest_gpu.log" 2>&1
grep -E "(FAILED|ERROR) |passed|failed" "$OUT/pytest_gpu.log" | tail -n 40
[ $# -gt 0 ] && exit 0   # a targeted pytest run skips the conformance matrix
python -m mla_dispatch conformance --json "$OUT/conformance.json" 2>&1 | tee "$OUT/conformance.log" | tail -n 45
