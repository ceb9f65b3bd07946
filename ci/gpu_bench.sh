#!/usr/bin/env bash
# The published benchmark: every available backend on docs/design.md §6's grids, one process.
#   bash ci/gpu_bench.sh [grids]     (default: flashmla,heads,latency,pages,fp8)
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
source ci/gpu_setup.sh
set -o pipefail
GRIDS=${1:-flashmla,heads,latency,pages,fp8}
python -m mla_dispatch build 2>&1 | tail -n 3
python -m mla_dispatch bench --grid "$GRIDS" --plot --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -n 120
