#!/usr/bin/env bash
# 2026-11-29 (session 6), device call 1 (nvidia-h200; carry [".whl", ".peer"]; <= 9.5 minutes): seesaw_fp8's first
# sparse instances (fp8_ds_mla, fp8_ds_v4; issue 57's producer-warpgroup design): the sparse tests (every sparse
# mainloop that takes each case, variant 9 among them), memcheck of variant 9 on both formats, and the dsv32 / dsv4
# grids beside wgmma (the plan's choice above 32 heads) and FlashMLA. One tarball.
SECONDS=0
stamp() { echo "[s6c1 ${SECONDS}s] $*"; }
R=/tmp/s6c1; L=$R/logs; mkdir -p $L $R/bench
source ci/gpu_setup.sh; source ci/flashmla_peer.sh > $L/flashmla_peer.log 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee $L/device.txt
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $? (${SECONDS}s)"; tail -n 1 $L/ext_build.log
stamp "sparse tests"
timeout 150 python -m pytest -q -rfE --tb=short -m gpu -n 8 --dist loadgroup -p no:cacheprovider \
  tests/test_cuda_sm90.py tests/test_ds_v4.py -k "sparse or binding_rejects or v4" > $L/tests.log 2>&1
echo "tests exit $?"; tail -n 1 $L/tests.log; grep -E "^(FAILED|ERROR)" $L/tests.log | head -20
stamp "memcheck"
for f in fp8_ds_mla fp8_ds_v4; do
  timeout 60 compute-sanitizer --tool memcheck python ci/sm90_sanitize.py --variants 9 --kv-format $f --sparse 256 \
    > $L/memcheck_$f.log 2>&1; echo "memcheck $f exit $?"; tail -n 2 $L/memcheck_$f.log
done
stamp "dsv32 / dsv4 grids"
timeout 200 python -m mla_dispatch bench --grid dsv32,dsv4 --backends cuda_sm90,cuda_sm90:variant=9,flashmla \
  --times graph --out $R/bench --quiet > $L/bench_sparse.log 2>&1; echo "bench exit $?"
grep -E "^\|" $L/bench_sparse.log | head -30
stamp "end"
tar -czf $OUT/s6c1.tar.gz -C $R logs bench; ls -l $OUT
