#!/usr/bin/env bash
# 2026-11-29 (session 5), device call 2 (nvidia-h200; carry [".whl", ".peer"]; <= 9.5 minutes): fp8t_convert's sparse
# instances (issue 57): every sparse and V4 test of tests/test_cuda_sm90.py (each case on every sparse mainloop that
# takes it), memcheck of variant 7 over fp8_ds_mla and fp8_ds_v4 top-k decode, and the dsv32 / dsv4 grids with
# the plan's choice beside etap (variant 6) and wgmma (variant 2) forced and FlashMLA. Everything lands in one tarball
# ($OUT keeps only a few files).
SECONDS=0
stamp() { echo "[s5c2 ${SECONDS}s] $*"; }
R=/tmp/s5c2; L=$R/logs; mkdir -p $L $R/bench
source ci/gpu_setup.sh; source ci/flashmla_peer.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $? (${SECONDS}s)"; tail -n 1 $L/ext_build.log
stamp "sparse tests"
timeout 170 python -m pytest -q -rfE --tb=short -m gpu -n 8 --dist loadgroup -p no:cacheprovider \
  tests/test_cuda_sm90.py -k "sparse" > $L/sparse_tests.log 2>&1
echo "tests exit $?"; tail -n 2 $L/sparse_tests.log; grep -E "^(FAILED|ERROR)" $L/sparse_tests.log | head -20
stamp "memcheck"
for f in fp8_ds_mla:256 fp8_ds_v4:128 fp8_e4m3:200; do
  timeout 60 compute-sanitizer --tool memcheck python ci/sm90_sanitize.py --variants 7 --kv-format ${f%%:*} \
    --sparse ${f##*:} > $L/memcheck_${f%%:*}.log 2>&1; echo "memcheck ${f%%:*} exit $?"; tail -n 3 $L/memcheck_${f%%:*}.log
done
stamp "dsv32 / dsv4 grids"
timeout 170 python -m mla_dispatch bench --grid dsv32,dsv4 \
  --backends cuda_sm90,cuda_sm90:variant=6,cuda_sm90:variant=2,flashmla --times graph --out $R/bench --quiet \
  > $L/bench_sparse.log 2>&1; echo "bench exit $?"
grep -E "^\| b" $L/bench_sparse.log | cut -c1-200 | head -70
stamp "end"
tar -czf $OUT/s5c2.tar.gz -C $R logs bench; ls -l $OUT
