#!/usr/bin/env bash
# 2026-11-29 (session 4), device call 2 (nvidia-h200; carry [".whl", ".peer"]; <= 9 minutes): etap's sparse instances
# (tokens on M, row tiles of 16; issue 57's tokens-on-M design for h_q <= 32): the sparse GPU tests (every sparse
# case on the plan's mainloop and the other), memcheck of the sparse instances (fp8_ds_mla, fp8_ds_v4), the dsv32 and
# dsv4 grids with wgmma and etap forced beside the plan's choice and FlashMLA, and ncu of etap at b=128 h_q=16.
SECONDS=0
stamp() { echo "[s4c2 ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L /tmp/ncu /tmp/bench
source ci/gpu_setup.sh; source ci/flashmla_peer.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $?"; tail -n 1 $L/ext_build.log
stamp "GPU tests: cuda_sm90 (all), compat and conformance sparse cells"
timeout 240 python -m pytest -q -rfE --tb=short -m gpu -n 8 -p no:cacheprovider tests/test_cuda_sm90.py \
  > $L/gpu_cuda_sm90.log 2>&1; echo "cuda_sm90 tests exit $?"; tail -n 3 $L/gpu_cuda_sm90.log
grep -E "^(FAILED|ERROR)" $L/gpu_cuda_sm90.log | head -20
timeout 120 python -m pytest -q -rfE --tb=short -m gpu -n 8 -p no:cacheprovider tests/test_compat_flash_mla.py \
  tests/test_conformance.py -k "sparse or v4" > $L/gpu_sparse_other.log 2>&1; echo "compat/conformance exit $?"
tail -n 3 $L/gpu_sparse_other.log; grep -E "^(FAILED|ERROR)" $L/gpu_sparse_other.log | head -10
stamp "memcheck"
timeout 90 compute-sanitizer --tool memcheck python ci/sm90_sanitize.py --variants 0,6 --kv-format fp8_ds_mla \
  --sparse 256 > $L/memcheck_ds_mla.log 2>&1; echo "memcheck ds_mla exit $?"; tail -n 4 $L/memcheck_ds_mla.log
timeout 60 compute-sanitizer --tool memcheck python ci/sm90_sanitize.py --variants 6 --kv-format fp8_ds_v4 \
  --sparse 128 > $L/memcheck_ds_v4.log 2>&1; echo "memcheck ds_v4 exit $?"; tail -n 4 $L/memcheck_ds_v4.log
stamp "bench"
timeout 200 python -m mla_dispatch bench --grid dsv32,dsv4 --backends cuda_sm90,cuda_sm90:variant=2,cuda_sm90:variant=6,flashmla \
  --times graph --out /tmp/bench --quiet > $L/bench.log 2>&1; echo "bench exit $?"
grep -E "^\| b" $L/bench.log | grep -v "unsupported\|flashmla |" | cut -d'|' -f2,3,4,7,8
stamp "ncu etap b128 h16"
timeout $((530 - SECONDS)) ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --section InstructionStats --section MemoryWorkloadAnalysis -k regex:mla_decode_etap -c 1 --csv --page details \
  python ci/sm90_sanitize.py --variants 0 --kv-format fp8_ds_mla --sparse 2048 --shape 128,2,16,32768 \
  > /tmp/ncu/ncu-etap-sparse-h16.csv 2> $L/ncu.log; echo "ncu exit $?"; grep -E "Duration|DRAM Throughput" /tmp/ncu/ncu-etap-sparse-h16.csv | cut -c1-20,200-400 | head
stamp "end"
tar -czf $OUT/s4c2.tar.gz -C /tmp logs ncu bench 2>/dev/null; ls -l $OUT
