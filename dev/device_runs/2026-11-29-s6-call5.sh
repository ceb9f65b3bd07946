#!/usr/bin/env bash
# 2026-11-29 (session 6), device call 5 (nvidia-h200; carry [".whl", ".peer"]; <= 9.5 minutes), the session's final
# kernel source: the dsv32 / dsv4 grids (the plan's choice, seesaw_fp8 forced, FlashMLA), ncu of FlashMLA's sparse
# kernel beside seesaw_fp8's and wgmma's on the same inputs, and the whole GPU suite. One tarball.
SECONDS=0
stamp() { echo "[s6c5 ${SECONDS}s] $*"; }
R=/tmp/s6c5; L=$R/logs; mkdir -p $L $R/bench
source ci/gpu_setup.sh; source ci/flashmla_peer.sh > $L/flashmla_peer.log 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee $L/device.txt
python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
  | tee $L/versions.txt
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $? (${SECONDS}s)"; tail -n 1 $L/ext_build.log
stamp "dsv32 / dsv4 grids"
timeout 120 python -m mla_dispatch bench --grid dsv32,dsv4 --backends cuda_sm90,cuda_sm90:variant=9,flashmla \
  --times graph --out $R/bench --quiet > $L/bench_sparse.log 2>&1; echo "bench exit $?"
grep -E "^\| b" $L/bench_sparse.log | grep -v "| flashmla |" | cut -d'|' -f2,3,7,8
stamp "ncu"
timeout 100 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --section InstructionStats --section MemoryWorkloadAnalysis \
  -k regex:"flash_fwd_splitkv_mla_fp8_sparse|mla_decode_(seesaw_fp8|wgmma)" -c 6 --csv --page raw \
  python dev/ncu_vs_flashmla.py --config 64,1,64,32768 --topk 2048 --variants 9,2 > $L/ncu_sparse.csv 2>&1
echo "ncu exit $?"
stamp "GPU suite"
timeout 290 python -m pytest -q -rfE --tb=short -m gpu -n 8 --dist loadgroup -p no:cacheprovider \
  -k "not grid_gpu and not nccl" --ignore tests/test_causal_tail.py tests > $L/gpu_suite.log 2>&1
echo "suite exit $?"; tail -n 1 $L/gpu_suite.log; grep -E "^(FAILED|ERROR)" $L/gpu_suite.log | head -20
stamp "end"
tar -czf $OUT/s6c5.tar.gz -C $R logs bench; ls -l $OUT
