#!/usr/bin/env bash
# 2026-11-29 (session 5), device call 4 (nvidia-h200; carry [".whl", ".peer", ".gpu_stage"]; <= 9.8 minutes), the
# session's final kernel source: the dsv32 / dsv4 grids (the plan's choice beside fp8t_convert, etap and wgmma forced,
# and FlashMLA), memcheck of fp8t_convert's sparse instances, the whole GPU suite, and `tune --quick` (FA3 in place)
# for the shipped H200 table. One tarball.
SECONDS=0
stamp() { echo "[s5c4 ${SECONDS}s] $*"; }
R=/tmp/s5c4; L=$R/logs; mkdir -p $L $R/bench $R/tables
source ci/gpu_setup.sh; source ci/flashmla_peer.sh
tar -xJf .gpu_stage/fa3_built.tar.xz -C .peer/flash-attention/hopper && source ci/fa3_peer.sh > $L/fa3_peer.log 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee $L/device.txt
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $? (${SECONDS}s)"; tail -n 1 $L/ext_build.log
stamp "dsv32 / dsv4 grids"
timeout 120 python -m mla_dispatch bench --grid dsv32,dsv4 \
  --backends cuda_sm90,cuda_sm90:variant=7,cuda_sm90:variant=6,cuda_sm90:variant=2,flashmla --times graph \
  --out $R/bench --quiet > $L/bench_sparse.log 2>&1; echo "bench exit $?"
grep -E "^\| b128-s2-h(16|32)" $L/bench_sparse.log | cut -d'|' -f2,3,7,8
stamp "memcheck"
for f in fp8_ds_mla:256 fp8_ds_v4:128; do
  timeout 40 compute-sanitizer --tool memcheck python ci/sm90_sanitize.py --variants 7 --kv-format ${f%%:*} \
    --sparse ${f##*:} > $L/memcheck_${f%%:*}.log 2>&1; echo "memcheck ${f%%:*} exit $?"; tail -n 1 $L/memcheck_${f%%:*}.log
done
stamp "GPU suite"
timeout 285 python -m pytest -q -rfE --tb=short -m gpu -n 8 --dist loadgroup -p no:cacheprovider \
  -k "not grid_gpu and not nccl" --ignore tests/test_causal_tail.py tests > $L/gpu_suite.log 2>&1
echo "suite exit $?"; tail -n 1 $L/gpu_suite.log; grep -E "^(FAILED|ERROR)" $L/gpu_suite.log | head -20
LEFT=$((575 - SECONDS)); BUDGET=$((LEFT - 25)); [ $BUDGET -gt 110 ] && BUDGET=110
stamp "tune --quick, budget ${BUDGET}s"
if [ $BUDGET -ge 40 ]; then
  timeout $LEFT python -m mla_dispatch tune --quick --backends cuda_sm90,flashmla,fa3,flashinfer,triton --metric graph \
    --rep-ms 25 --budget-s $BUDGET --quiet --out $R/tables/NVIDIA_H200_sm_90.json > $L/tune.log 2>&1
  echo "tune exit $?"; grep -E "^\| rows|measured" $L/tune.log | cut -c1-150
fi
stamp "end"
tar -czf $OUT/s5c4.tar.gz -C $R logs bench tables; ls -l $OUT
