#!/usr/bin/env bash
# 2026-11-29 evening, device call B (nvidia-h200; carry [".whl", ".peer"]; <= 9.5 minutes), on the final source of:
#   - issue 55's host-path work (split-KV plans taking views, schedule and the bound native schedule from the pool;
#     binding.cpp's PlannedSchedule): the GPU tests of what changed, then dev/host_cost.py (each call with a device
#     sync as the issue measures it, and its host cost alone with the GPU kept busy) and the integration profile;
#   - issue 57's two-list merge (a sparse plan with an extra cache merges both lists in one combine): the V4 GPU
#     tests, then the 16 FlashMLA sparse cases that failed in call C, each alone (dev/flashmla_test.py --cases).
SECONDS=0
stamp() { echo "[e1B ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L /tmp/host_cost /tmp/iprof /tmp/sparse
source ci/gpu_setup.sh; source ci/flashmla_peer.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $?"; tail -n 1 $L/ext_build.log
export PYTHONPATH=dev:$PYTHONPATH
stamp "GPU tests of the change"
PYTEST_LIVE_LOG=$L/live.log timeout 150 python -m pytest -q -rfE --tb=short -m gpu -n 8 -p no:cacheprovider \
  -p pytest_live_log tests/test_split_plan.py tests/test_host_path.py tests/test_stale_plan.py tests/test_ds_v4.py \
  tests/test_launch_records.py tests/test_integrations_transformers.py tests/test_cuda_sm90_plan.py \
  tests/test_cuda_sm90.py -k "not variant or sparse or graph or bound" > $L/tests.log 2>&1
echo "tests exit $?"; tail -n 2 $L/tests.log; grep -E "^(FAILED|ERROR) " $L/live.log | head -20
stamp "FlashMLA's 16 failed sparse cases, alone"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 100 python dev/flashmla_test.py sparse .peer/flashmla/tests \
  --backend cuda_sm90 --cases benchmarks/h200-flashmla-sparse-all-cuda_sm90.json --json /tmp/sparse/rerun.json \
  > $L/sparse_rerun.log 2>&1; echo "sparse rerun exit $?"; tail -n 1 $L/sparse_rerun.log
stamp "host cost"
timeout 140 python dev/host_cost.py --reps 30 --out /tmp/host_cost > $L/host_cost.log 2>&1; echo "host cost exit $?"
tail -n 30 $L/host_cost.log
stamp "integration profile"
timeout $((560 - SECONDS)) python dev/integration_profile.py --backends stock:eager,cuda_sm90,triton --prompt 1024 \
  --new 8 --out /tmp/iprof > $L/iprof.log 2>&1; echo "iprof exit $?"; tail -n 24 $L/iprof.log
stamp "end"
tar -czf $OUT/e1B.tar.gz -C /tmp logs host_cost iprof sparse 2>/dev/null; ls -l $OUT
