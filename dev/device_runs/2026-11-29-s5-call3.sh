#!/usr/bin/env bash
# 2026-11-29 (session 5), device call 3 (nvidia-h200; carry [".whl"]; <= 6 minutes): why the sparse decode of 16
# heads runs at ~1.3 TB/s whatever the mainloop (issue 57): the gather ceiling of the dsv32 grid's own ids
# (dev/gather_ceiling.py: a read-only Triton gather of the same rows, and the same rows sorted), and ncu of
# fp8t_convert (variant 7) beside etap (variant 6) at b=128 s_q=2 h_q=16 top-k 2048 of 32K (fp8_ds_mla), and of
# fp8t_convert over fp8_ds_v4. One tarball.
SECONDS=0
stamp() { echo "[s5c3 ${SECONDS}s] $*"; }
R=/tmp/s5c3; L=$R/logs; mkdir -p $L $R/ncu
source ci/gpu_setup.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $? (${SECONDS}s)"
stamp "gather ceiling"
for h in 16 128; do timeout 80 python dev/gather_ceiling.py --heads $h 2>&1 | tail -n 4 | tee $L/gather_h$h.log; done
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats"
stamp "ncu v7 / v6 fp8_ds_mla h16"
timeout 120 ncu --clock-control none $SECTIONS -k regex:"mla_decode_fp8t_convert|mla_decode_etap" -c 2 \
  python ci/sm90_sanitize.py --variants 7,6 --kv-format fp8_ds_mla --sparse 2048 --shape 128,2,16,32768 \
  > $R/ncu/ds_mla_h16.txt 2>&1; echo "ncu exit $?"
grep -E "mla_decode|Duration|DRAM Throughput|Memory Throughput|L2 Hit Rate|L1/TEX Hit|Issue Slots Busy|No Eligible|Active Warps Per|Eligible Warps|Warp Cycles Per Issued" $R/ncu/ds_mla_h16.txt | head -40
stamp "ncu v7 fp8_ds_v4 h16"
timeout 90 ncu --clock-control none $SECTIONS -k regex:"mla_decode_fp8t_convert" -c 1 \
  python ci/sm90_sanitize.py --variants 7 --kv-format fp8_ds_v4 --sparse 2048 --shape 128,2,16,32768 \
  > $R/ncu/ds_v4_h16.txt 2>&1; echo "ncu exit $?"
grep -E "mla_decode|Duration|DRAM Throughput|L2 Hit Rate|Issue Slots Busy|No Eligible|Warp Cycles Per Issued" $R/ncu/ds_v4_h16.txt | head -12
stamp "end"
tar -czf $OUT/s5c3.tar.gz -C $R logs ncu; ls -l $OUT
