#!/usr/bin/env bash
# 2026-11-29 (session 6), device call 2 (nvidia-h200; carry [".whl", ".peer"]; <= 5 minutes): seesaw_fp8's sparse
# converter with the id queue and the L2 prefetch a stage ahead: the sparse tests, memcheck (fp8_ds_mla), and the
# h_q 64 / 128 rows of the dsv32 / dsv4 grids against FlashMLA; ncu of variant 9 at b=64 h_q=64.
SECONDS=0
stamp() { echo "[s6c2 ${SECONDS}s] $*"; }
R=/tmp/s6c2; L=$R/logs; mkdir -p $L $R/bench
source ci/gpu_setup.sh; source ci/flashmla_peer.sh > $L/flashmla_peer.log 2>&1
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $? (${SECONDS}s)"; tail -n 1 $L/ext_build.log
timeout 100 python -m pytest -q -rfE --tb=short -m gpu -n 8 --dist loadgroup -p no:cacheprovider \
  tests/test_cuda_sm90.py tests/test_ds_v4.py -k "sparse or v4" > $L/tests.log 2>&1
echo "tests exit $?"; tail -n 1 $L/tests.log; grep -E "^(FAILED|ERROR)" $L/tests.log | head -20
timeout 60 compute-sanitizer --tool memcheck python ci/sm90_sanitize.py --variants 9 --kv-format fp8_ds_mla \
  --sparse 256 > $L/memcheck.log 2>&1; echo "memcheck exit $?"; tail -n 1 $L/memcheck.log
stamp "bench"
timeout 150 python -m mla_dispatch bench --grid dsv32,dsv4 --only h64,h128 --backends cuda_sm90:variant=9,flashmla \
  --times graph --out $R/bench --quiet > $L/bench_sparse.log 2>&1; echo "bench exit $?"
grep -E "^\| b" $L/bench_sparse.log | grep -v "| flashmla |" | cut -d'|' -f2,3,7,8
stamp "ncu"
timeout 60 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
  -k regex:mla_decode_seesaw_fp8 -c 1 --csv --page details python ci/sm90_sanitize.py --variants 9 \
  --kv-format fp8_ds_mla --sparse 2048 --shape 64,1,64,32768 > $L/ncu.csv 2>&1; echo "ncu exit $?"
grep -E "Duration|DRAM Throughput|Memory Throughput|Warp Cycles Per Issued|Stall" $L/ncu.csv | cut -c1-160 | head -20
stamp "end"
tar -czf $OUT/s6c2.tar.gz -C $R logs bench; ls -l $OUT
