#!/usr/bin/env bash
# Next session, device call 1 (nvidia-h200; carry [".whl", ".peer"]; <= 9.5 minutes): the evidence issues 54 and 57
# ask for before their designs, on main as the 2026-11-29 late-night session left it (GPU suite 685 passed there):
#   - issue 54: ncu of FlashMLA's dense kernel and ours on the same inputs at the rows furthest from it on the H200
#     (b=64 L=8K h_q=64, b=8 L=8K h_q=128, b=128 L-bar 8K h_q=128): instructions, DRAM throughput, stall reasons;
#   - issue 57: the dsv32 and dsv4 grids (its item 2 table: V3.2 rows, V4 rows) beside FlashMLA's sparse kernels.
# ncu with --clock-control none (the device notes: HOPPER.md), two launches of each kernel (-c 4).
SECONDS=0
stamp() { echo "[next1 ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L /tmp/ncu /tmp/bench
source ci/gpu_setup.sh; source ci/flashmla_peer.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $?"; tail -n 1 $L/ext_build.log
for cfg in 64,1,64,8192 8,1,128,8192 128,1,128,8192; do
  stamp "ncu $cfg"
  timeout 110 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section InstructionStats --section MemoryWorkloadAnalysis --section Occupancy \
    -k regex:"flash_fwd_splitkv_mla|mla_decode_(wgmma|seesaw|etap|fp8t)" -c 4 --csv --page details \
    python dev/ncu_vs_flashmla.py --config $cfg > /tmp/ncu/ncu-${cfg//,/-}.csv 2> $L/ncu-${cfg//,/-}.log
  echo "ncu exit $?"; wc -l < /tmp/ncu/ncu-${cfg//,/-}.csv
done
stamp "dsv32 grid"
timeout $((540 - SECONDS)) python -m mla_dispatch bench --grid dsv32,dsv4 --backends cuda_sm90,triton,flashmla --times graph \
  --out /tmp/bench --quiet > $L/bench.log 2>&1; echo "bench exit $?"; tail -n 12 $L/bench.log
stamp "end"
tar -czf $OUT/next1.tar.gz -C /tmp logs ncu bench 2>/dev/null; ls -l $OUT
