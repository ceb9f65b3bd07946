#!/usr/bin/env bash
# Next session, device call 1 (nvidia-h200; carry [".whl", ".peer", ".gpu_stage"]; <= 9.5 minutes): what the
# 2026-11-29 evening session built after its last device call, on the GPU (main d213379 and later):
#   - the two-list merge's review fixes (the lists' own plans hold no partial rows; a reason past 65,535 requests),
#     the flashinfer adapter's pooled page lists / offsets / LSE buffer, the transformers integration's RoPE tables
#     per forward and Python slots: their GPU tests, then the rest of the GPU suite (no test_causal_tail);
#   - FlashMLA's whole sparse test through compat on cuda_sm90 again on this source (16 shards, failures alone) is
#     next-session-call2.sh.
SECONDS=0
stamp() { echo "[next1 ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L
tar -xJf .gpu_stage/fa3_built.tar.xz -C .peer/flash-attention/hopper
source ci/gpu_setup.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $?"; tail -n 2 $L/ext_build.log
source ci/flashmla_peer.sh; source ci/fa3_peer.sh
export PYTHONPATH=dev:$PYTHONPATH
stamp "GPU tests of the evening's last changes"
PYTEST_LIVE_LOG=$L/live_changed.log timeout 150 python -m pytest -q -rfE --tb=short -m gpu -n 8 -p no:cacheprovider \
  -p pytest_live_log tests/test_ds_v4.py tests/test_vendor_flashinfer.py tests/test_page_lists.py \
  tests/test_integrations_transformers.py tests/test_split_plan.py tests/test_cuda_sm90.py -k "sparse or v4 or not variant" \
  > $L/changed.log 2>&1
echo "changed exit $?"; tail -n 2 $L/changed.log; grep -E "^(FAILED|ERROR) " $L/live_changed.log | head -20
stamp "the rest of the GPU suite"
PYTEST_LIVE_LOG=$L/live.log timeout $((520 - SECONDS)) python -m pytest -q -rfE --tb=short -m gpu -n 8 \
  --dist loadgroup -p no:cacheprovider -p pytest_live_log -k "not grid_gpu and not nccl" \
  --ignore tests/test_causal_tail.py --ignore tests/test_ds_v4.py --ignore tests/test_vendor_flashinfer.py \
  --ignore tests/test_cuda_sm90.py tests > $L/gpu_suite.log 2>&1
echo "suite exit $?"; tail -n 2 $L/gpu_suite.log; grep -E "^(FAILED|ERROR|XPASS)" $L/live.log | head -30
stamp "end"
tar -czf $OUT/next1.tar.gz -C /tmp logs 2>/dev/null; ls -l $OUT
