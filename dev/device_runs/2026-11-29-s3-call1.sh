#!/usr/bin/env bash
# Session 3, device call 1 (nvidia-h200): FA3 peer build in the background, packed to come back in <= 15 MiB parts;
# our extension; the GPU suite but test_cuda_sm90.py (488/488 last session) with short tracebacks; test_stale_plan's
# GPU cases with long tracebacks; conformance of cuda_sm90 (V4 + extra cache cell); FA3's tests and conformance.
SECONDS=0
stamp() { echo "[s3c1 ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L
source ci/gpu_setup.sh
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee $L/device.txt
( SECONDS=0; MAX_JOBS=8 bash ci/build_fa3_peer.sh .peer/flash-attention > $L/fa3_build.log 2>&1; echo "fa3 build rc=$? in ${SECONDS}s" >> $L/fa3_build.log; touch /tmp/fa3_done ) &
stamp "building our extension"
( time python -m mla_dispatch build ) > $L/ext_build.log 2>&1; tail -n 3 $L/ext_build.log
source ci/flashmla_peer.sh
stamp "stale plan, long tracebacks"
timeout 60 python -m pytest -q -rfE --tb=long -m gpu -p no:cacheprovider tests/test_stale_plan.py > $L/stale.log 2>&1
echo "stale exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|Error" $L/stale.log | head -20
stamp "GPU suite but test_cuda_sm90.py"
timeout 230 python -m pytest -q -rfE --tb=short -m gpu -n 8 --dist loadgroup -p no:cacheprovider -k "not grid_gpu and not nccl" --ignore tests/test_cuda_sm90.py --ignore tests/test_stale_plan.py tests > $L/gpu_suite.log 2>&1
echo "suite exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" $L/gpu_suite.log | head -40
stamp "conformance cuda_sm90"
timeout 60 python -m mla_dispatch conformance --backends cuda_sm90 --quiet --json $L/conformance_sm90.json > $L/conformance_sm90.log 2>&1
echo "conformance exit $?"; tail -n 12 $L/conformance_sm90.log
stamp "waiting for FA3"
while [ ! -f /tmp/fa3_done ] && [ $SECONDS -lt 430 ]; do sleep 3; done
tail -n 2 $L/fa3_build.log
if ls .peer/flash-attention/hopper/flash_attn_3/_C*.so >/dev/null 2>&1; then
  ls -l .peer/flash-attention/hopper/flash_attn_3/_C*.so
  tar -C .peer/flash-attention/hopper -cf - flash_attn_3 flash_attn_config.py | xz -T8 -6 | split -b 15M - $OUT/fa3_built.tar.xz.part_
  ls -l $OUT
  source ci/fa3_peer.sh
  stamp "fa3 tests + conformance"
  timeout 60 python -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider tests/test_vendor_fa3.py > $L/fa3_tests.log 2>&1; echo "fa3 tests exit $?"; tail -n 5 $L/fa3_tests.log
  timeout 70 python -m mla_dispatch conformance --backends fa3 --quiet --json $L/conformance_fa3.json > $L/conformance_fa3.log 2>&1; echo "fa3 conformance exit $?"; tail -n 14 $L/conformance_fa3.log
fi
stamp "end"
tar -czf $OUT/logs.tar.gz -C /tmp logs
