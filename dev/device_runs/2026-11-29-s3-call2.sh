#!/usr/bin/env bash
# Session 3, device call 2 (nvidia-h200): FA3 from call 1's build (.gpu_stage/fa3_built.tar.xz); test_stale_plan's and
# test_vendor_fa3's GPU cases; ci/h200_auto.sh with FA3 installed (tune --quick, four grids, auto and the fastest
# timed in alternation); dev/host_cost.py with its cProfiles. Everything comes back in one tar.
SECONDS=0
stamp() { echo "[s3c2 ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L
tar -xJf .gpu_stage/fa3_built.tar.xz -C .peer/flash-attention/hopper && ls .peer/flash-attention/hopper/flash_attn_3
source ci/gpu_setup.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; tail -n 1 $L/ext_build.log
source ci/flashmla_peer.sh; source ci/fa3_peer.sh
export MLA_GPU_SETUP_DONE=1
stamp "stale plan + fa3 GPU tests"
PYTHONPATH=dev:$PYTHONPATH PYTEST_LIVE_LOG=$L/live_quick.log timeout 90 python -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -p pytest_live_log tests/test_stale_plan.py tests/test_vendor_fa3.py > $L/quick_tests.log 2>&1
echo "quick tests exit $?"; tail -n 12 $L/quick_tests.log
stamp "h200_auto"
OUT=/tmp/auto H200_AUTO_LIMIT_S=330 H200_AUTO_REP_MS=40 bash ci/h200_auto.sh > $L/h200_auto.log 2>&1
echo "h200_auto exit $?"; grep -E "^\[h200_auto|auto within|FAILED|WARNING" $L/h200_auto.log | tail -n 20
stamp "host cost"
left=$((560 - SECONDS)); [ $left -gt 200 ] && left=200
[ $left -gt 30 ] && timeout $left python dev/host_cost.py --reps 30 --out /tmp/host_cost > $L/host_cost.log 2>&1
echo "host_cost exit $?"; tail -n 28 $L/host_cost.log
stamp "end"
tar -czf $OUT/call2.tar.gz -C /tmp logs auto host_cost 2>/dev/null; ls -l $OUT
