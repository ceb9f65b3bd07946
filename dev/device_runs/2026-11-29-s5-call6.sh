#!/usr/bin/env bash
# 2026-11-29 (session 5), device call 6 (nvidia-h200; carry [".whl"]; <= 4 minutes), the session's final source (comments
# changed since call 4; dev/sass_compare.py compares the machine code): the sparse tests of tests/test_cuda_sm90.py and
# memcheck of fp8t_convert's 32-row sparse instances (the sanitize script's own shapes give it 16 rows only).
SECONDS=0
stamp() { echo "[s5c6 ${SECONDS}s] $*"; }
R=/tmp/s5c6; L=$R/logs; mkdir -p $L
source ci/gpu_setup.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $? (${SECONDS}s)"; tail -n 1 $L/ext_build.log
timeout 90 python -m pytest -q -rfE --tb=short -m gpu -n 8 --dist loadgroup -p no:cacheprovider \
  tests/test_cuda_sm90.py -k "sparse" > $L/sparse_tests.log 2>&1
echo "tests exit $?"; tail -n 1 $L/sparse_tests.log; grep -E "^(FAILED|ERROR)" $L/sparse_tests.log | head -20
for f in fp8_ds_mla:256 fp8_ds_v4:128 fp8_e4m3:200; do
  timeout 45 compute-sanitizer --tool memcheck python ci/sm90_sanitize.py --variants 7 --kv-format ${f%%:*} \
    --sparse ${f##*:} --shape 3,2,32,700 > $L/memcheck32_${f%%:*}.log 2>&1
  echo "memcheck 32 rows ${f%%:*} exit $?"; tail -n 2 $L/memcheck32_${f%%:*}.log
done
stamp "end"
tar -czf $OUT/s5c6.tar.gz -C $R logs; ls -l $OUT
