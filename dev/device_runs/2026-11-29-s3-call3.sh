#!/usr/bin/env bash
# Session 3, device call 3 (nvidia-h200): the GPU suite but test_cuda_sm90.py (488/488 this morning, its source
# unchanged since), test_stale_plan.py and test_vendor_fa3.py (call 2), with every outcome, duration and failure's
# traceback logged as it arrives (dev/pytest_live_log.py), FlashMLA and FA3 installed.
SECONDS=0
stamp() { echo "[s3c3 ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L
tar -xJf .gpu_stage/fa3_built.tar.xz -C .peer/flash-attention/hopper
source ci/gpu_setup.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; tail -n 1 $L/ext_build.log
source ci/flashmla_peer.sh; source ci/fa3_peer.sh
stamp "GPU suite"
PYTHONPATH=dev:$PYTHONPATH PYTEST_LIVE_LOG=$L/live.log timeout 420 python -m pytest -q -rfE --tb=short -m gpu -n 8 \
  --dist loadgroup -p no:cacheprovider -p pytest_live_log -k "not grid_gpu and not nccl" --ignore tests/test_cuda_sm90.py \
  --ignore tests/test_stale_plan.py --ignore tests/test_vendor_fa3.py tests > $L/gpu_suite.log 2>&1
echo "suite exit $?"; tail -n 3 $L/gpu_suite.log
grep -E "^(FAILED|ERROR) " $L/live.log | head -40
echo "slowest:"; sort -k2 -n -r $L/live.log | grep -E "^[A-Z]" | head -12
stamp "end"
tar -czf $OUT/call3.tar.gz -C /tmp logs
