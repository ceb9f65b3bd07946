#!/usr/bin/env bash
# 2026-11-29 evening, device call E (nvidia-h200; carry [".whl"]; what was left of the session's device time, ~2
# minutes after the machine's start): the GPU tests of what was built after call D that need no extension build -
# the kept Triton launches' addresses (test_triton_launch), the flashinfer adapter's pooled buffers
# (test_vendor_flashinfer, test_page_lists), the transformers integration's RoPE tables and slots on triton.
SECONDS=0
L=/tmp/logs; mkdir -p $L
source ci/gpu_setup.sh
export PYTHONPATH=dev:$PYTHONPATH
PYTEST_LIVE_LOG=$L/live.log timeout $((100 - SECONDS)) python -m pytest -q -rfE --tb=short -m gpu -n 8 -p no:cacheprovider \
  -p pytest_live_log tests/test_triton_launch.py tests/test_vendor_flashinfer.py tests/test_page_lists.py \
  "tests/test_integrations_transformers.py" -k "not cuda_sm90" > $L/tests.log 2>&1
echo "tests exit $? after ${SECONDS}s"; tail -n 3 $L/tests.log; grep -E "^(PASSED|FAILED|ERROR)" $L/live.log | head -40
