#!/usr/bin/env bash
# FlashMLA's own sparse-decoding test (tests/test_flash_mla_sparse_decoding.py: its DeepSeek-V3.2 and MODEL1 /
# DeepSeek-V4 cases) through mla_dispatch.compat.flash_mla on one backend, as SHARDS processes side by side on one
# GPU (dev/flashmla_test.py --shard; the cases' data and reference are host-bound), each under a time limit.
#
#   bash dev/flashmla_sparse_all.sh FLASHMLA_TESTS BACKEND FIRST LAST OF [EXTRA ARGS]
#
# runs shards FIRST..LAST of OF (so two calls, 0 7 16 and 8 15 16, cover every case) and writes
# $OUT/flashmla_sparse_<backend>_<k>of<OF>.json / .log; the last line it prints sums the shards' counts.
# Needs `source ci/gpu_setup.sh` first and FlashMLA's tests/ folder (reference/flashmla_on_device.md: no build).
set -u
tests=$1 backend=$2 first=$3 last=$4 of=$5
shift 5
out=${OUT:-.}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for k in $(seq "$first" "$last"); do
  timeout "${SHARD_TIMEOUT:-540}" python dev/flashmla_test.py sparse "$tests" --backend "$backend" --shard "$k/$of" \
    --json "$out/flashmla_sparse_${backend}_${k}of${of}.json" "$@" > "$out/flashmla_sparse_${backend}_${k}of${of}.log" 2>&1 &
done
wait
python - "$out" "$backend" "$of" <<'EOF'
import glob, json, sys
out, backend, of = sys.argv[1:]
tot = {"taken": 0, "passed": 0, "failed": 0, "v32": [0, 0], "model1": [0, 0], "shards": 0}
for f in sorted(glob.glob(f"{out}/flashmla_sparse_{backend}_*of{of}.json")):
    d = json.load(open(f))
    tot["shards"] += 1
    for k in ("taken", "passed", "failed"):
        tot[k] += d[k]
    for m in ("v32", "model1"):
        tot[m][0] += d["per_model"][m]["passed"]
        tot[m][1] += d["per_model"][m]["taken"]
print(json.dumps({"backend": backend, **tot}))
EOF
