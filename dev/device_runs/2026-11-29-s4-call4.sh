#!/usr/bin/env bash
# 2026-11-29 (session 4), device call 4 (nvidia-h200; carry [".whl", ".peer"]; <= 9 minutes), the session's final
# source: the GPU suite; the dsv32 and dsv4 grids (issue 57's table, wgmma forced beside the plan's choice, triton,
# FlashMLA); the hopper grid (issue 54's table) with mainloop seesaw forced beside the plan's choice (its small-batch
# rows); ncu's stall reasons of seesaw and FlashMLA's dense kernel at b=128 h_q=128 L-bar 8K.
SECONDS=0
stamp() { echo "[s4c4 ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L /tmp/bench /tmp/ncu
source ci/gpu_setup.sh; source ci/flashmla_peer.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $?"; tail -n 1 $L/ext_build.log
export PYTHONPATH=dev:$PYTHONPATH
stamp "the GPU suite"
PYTEST_LIVE_LOG=$L/live.log timeout 270 python -m pytest -q -rfE --tb=short -m gpu -n 8 --dist loadgroup \
  -p no:cacheprovider -p pytest_live_log -k "not grid_gpu and not nccl" --ignore tests/test_causal_tail.py tests \
  > $L/gpu_suite.log 2>&1
echo "suite exit $?"; tail -n 2 $L/gpu_suite.log; grep -E "^(FAILED|ERROR|XPASS)" $L/live.log | head -20
stamp "dsv32 / dsv4 grids"
timeout 120 python -m mla_dispatch bench --grid dsv32,dsv4 --backends cuda_sm90,cuda_sm90:variant=2,triton,flashmla \
  --times graph --out /tmp/bench/sparse --quiet > $L/bench_sparse.log 2>&1; echo "bench sparse exit $?"
stamp "hopper grid"
timeout 150 python -m mla_dispatch bench --grid hopper --backends cuda_sm90,cuda_sm90:variant=5,triton,flashmla \
  --times graph --out /tmp/bench/hopper --quiet > $L/bench_hopper.log 2>&1; echo "bench hopper exit $?"
stamp "ncu stall reasons"
timeout 90 ncu --clock-control none --section WarpStateStats --section SourceCounters \
  -k regex:"flash_fwd_splitkv_mla|mla_decode_seesaw" -c 4 --csv --page raw \
  python dev/ncu_vs_flashmla.py --config 128,1,128,8192 > /tmp/ncu/ncu-stalls-128-1-128-8192.csv 2> $L/ncu.log
echo "ncu exit $?"
stamp "end"
tar -czf $OUT/s4c4.tar.gz -C /tmp logs bench ncu 2>/dev/null; ls -l $OUT
