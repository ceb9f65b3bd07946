#!/usr/bin/env bash
# Lead's device call 2 (nvidia-h200): our extension; the GPU tests of what the merges touched (cuda_sm90, triton,
# plans, launch records, stale plans, causal tails, V4, compat smoke); the V4 conformance cells on cuda_sm90; then
# issue 56's auto check (ci/h200_auto.sh) with what time is left. At most 8 files come back: logs are tarred.
SECONDS=0
stamp() { echo "[call2 ${SECONDS}s] $*"; }
source ci/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader > $OUT/device.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" >> $OUT/device.txt
stamp "building our extension"
( time python -m mla_dispatch build ) 2>&1 | tail -n 3
source ci/flashmla_peer.sh
stamp "GPU tests"
timeout 165 python -m pytest -v -rfE -m gpu -n 8 --dist loadgroup -p no:cacheprovider \
  tests/test_cuda_sm90.py tests/test_triton_gpu.py tests/test_stale_plan.py tests/test_launch_records.py \
  tests/test_split_plan.py tests/test_schedule_triton.py tests/test_triton_launch.py tests/test_causal_tail.py \
  tests/test_batch_invariant.py tests/test_api.py tests/test_gpu_foundation.py tests/test_vendor_flashmla.py \
  tests/test_vendor_flashinfer.py tests/test_integrations_transformers.py tests/test_flashmla_sched.py \
  tests/test_dcp.py tests/test_compat_flash_mla.py -k "not grid_gpu and not nccl" > $OUT/gpu_tests.log 2>&1
echo "tests exit $?"
grep -E "^FAILED|^ERROR| passed| failed" $OUT/gpu_tests.log | head -60
echo "passed lines: $(grep -c ' PASSED ' $OUT/gpu_tests.log), failed: $(grep -c ' FAILED ' $OUT/gpu_tests.log), skipped: $(grep -c ' SKIPPED ' $OUT/gpu_tests.log)"
stamp "V4 conformance on cuda_sm90 and triton"
timeout 40 python -m mla_dispatch conformance --backends cuda_sm90,triton --quiet --json $OUT/conformance.json > /tmp/conf.log 2>&1
echo "conformance exit $?"; grep -E "failing|fp8_ds_v4" /tmp/conf.log | head -8
LIMIT=$((582 - SECONDS))
stamp "h200_auto with ${LIMIT}s"
mkdir -p /tmp/auto
OUT=/tmp/auto H200_AUTO_LIMIT_S=$LIMIT H200_AUTO_REP_MS=40 bash ci/h200_auto.sh > /tmp/auto/h200_auto.log 2>&1
echo "h200_auto exit $?"
tail -n 45 /tmp/auto/h200_auto.log
tar czf $OUT/auto.tgz -C /tmp auto 2>/dev/null; ls -la $OUT
stamp "end"
