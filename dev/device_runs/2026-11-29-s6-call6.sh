#!/usr/bin/env bash
# 2026-11-29 (session 6), device call 6 (nvidia-h200; carry [".whl", ".peer"]; <= 9 minutes), the session's final
# source (kernels as call 5's): a forced variant that cannot run a config reported as unsupported (bench exits 0),
# and the whole GPU suite with room to finish. One tarball.
SECONDS=0
stamp() { echo "[s6c6 ${SECONDS}s] $*"; }
R=/tmp/s6c6; L=$R/logs; mkdir -p $L $R/bench
source ci/gpu_setup.sh; source ci/flashmla_peer.sh > $L/flashmla_peer.log 2>&1
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $? (${SECONDS}s)"; tail -n 1 $L/ext_build.log
timeout 40 python -m mla_dispatch bench --grid dsv32 --only b64-s1-h64 --backends cuda_sm90:variant=7 --times graph \
  --out $R/bench --quiet > $L/bench_forced.log 2>&1; echo "forced bench exit $?"
grep -E "^\| b" $L/bench_forced.log | cut -d'|' -f2,3,4 | cut -c1-200
stamp "GPU suite"
timeout 400 python -m pytest -q -rfE --tb=short -m gpu -n 8 --dist loadgroup -p no:cacheprovider \
  -k "not grid_gpu and not nccl" --ignore tests/test_causal_tail.py tests > $L/gpu_suite.log 2>&1
echo "suite exit $?"; tail -n 1 $L/gpu_suite.log; grep -E "^(FAILED|ERROR)" $L/gpu_suite.log | head -20
stamp "end"
tar -czf $OUT/s6c6.tar.gz -C $R logs bench; ls -l $OUT
