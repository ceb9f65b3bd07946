#!/usr/bin/env bash
# 2026-11-29 (session 6), device call 4 (nvidia-h200; carry [".whl", ".peer"]; <= 8 minutes): seesaw_fp8's sparse
# converter with its blocks in pairs and stage 1's RoPE values and scales asked of L2 (A), then the same without that
# prefetch (B, a sed of this copy of the tree, rebuilt: the build is keyed by the source's hash): the sparse tests,
# memcheck of both formats, and the h_q 64 / 128 rows of dsv32 / dsv4 beside FlashMLA for each; ncu as in call 3.
SECONDS=0
stamp() { echo "[s6c4 ${SECONDS}s] $*"; }
R=/tmp/s6c4; L=$R/logs; mkdir -p $L $R/benchA $R/benchB
source ci/gpu_setup.sh; source ci/flashmla_peer.sh > $L/flashmla_peer.log 2>&1
SRC=mla_dispatch/kernels/cuda/mla_decode_sm90/seesaw_fp8/seesaw_fp8.cuh
bench() {  # $1: the folder
  timeout 110 python -m mla_dispatch bench --grid dsv32,dsv4 --only b64-s1-h64,b128-s2-h128,b2-s2-h128 \
    --backends cuda_sm90:variant=9,flashmla --times graph --out $R/$1 --quiet > $L/$1.log 2>&1; echo "bench $1 exit $?"
  grep -E "^\| b" $L/$1.log | grep -v "| flashmla |" | cut -d'|' -f2,3,7,8
}
python -m mla_dispatch build > $L/buildA.log 2>&1; echo "build A exit $? (${SECONDS}s)"; tail -n 1 $L/buildA.log
timeout 80 python -m pytest -q -rfE --tb=short -m gpu -n 8 --dist loadgroup -p no:cacheprovider \
  tests/test_cuda_sm90.py -k "sparse" > $L/tests.log 2>&1
echo "tests exit $?"; tail -n 1 $L/tests.log; grep -E "^(FAILED|ERROR)" $L/tests.log | head -20
stamp "bench A"; bench benchA
stamp "ncu A"
timeout 90 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
  --section SchedulerStats --section InstructionStats -k regex:"mla_decode_(seesaw_fp8|wgmma)" -c 2 --csv \
  --page raw python ci/sm90_sanitize.py --variants 9,2 --kv-format fp8_ds_mla --sparse 2048 --shape 64,1,64,32768 \
  > $L/ncuA.csv 2>&1; echo "ncu exit $?"
for f in fp8_ds_mla fp8_ds_v4; do
  timeout 50 compute-sanitizer --tool memcheck python ci/sm90_sanitize.py --variants 9 --kv-format $f --sparse 256 \
    > $L/memcheck_$f.log 2>&1; echo "memcheck $f exit $?"; tail -n 1 $L/memcheck_$f.log
done
stamp "B: no L2 prefetch of stage 1's RoPE values and scales"
sed -i 's/if (S == 1 \&\& q == 0 \&\& valid\[h\] \&\& !bad\[h\])/if (false \&\& valid[h] \&\& !bad[h])/' $SRC
grep -c "if (false && valid" $SRC
python -m mla_dispatch build > $L/buildB.log 2>&1; echo "build B exit $? (${SECONDS}s)"; tail -n 1 $L/buildB.log
bench benchB
stamp "end"
tar -czf $OUT/s6c4.tar.gz -C $R logs benchA benchB; ls -l $OUT
