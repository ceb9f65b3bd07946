#!/usr/bin/env bash
# 2026-11-29 (session 5), device call 7 (nvidia-h200; carry [".whl"]; <= 3 minutes), the session's final source:
# binding.cpp's sparse etap tile read from kEtapFp8MaxRows (was the literal 16); the binding's refusals (two new
# sparse ones) and every sparse test of tests/test_cuda_sm90.py.
SECONDS=0
R=/tmp/s5c7; L=$R/logs; mkdir -p $L
source ci/gpu_setup.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $? (${SECONDS}s)"; tail -n 1 $L/ext_build.log
timeout 100 python -m pytest -q -rfE --tb=short -m gpu -n 8 --dist loadgroup -p no:cacheprovider \
  tests/test_cuda_sm90.py -k "sparse or binding_rejects" > $L/tests.log 2>&1
echo "tests exit $? (${SECONDS}s)"; tail -n 1 $L/tests.log; grep -E "^(FAILED|ERROR)" $L/tests.log | head -20
tar -czf $OUT/s5c7.tar.gz -C $R logs; ls -l $OUT
