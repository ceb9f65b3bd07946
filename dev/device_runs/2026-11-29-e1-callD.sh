#!/usr/bin/env bash
# 2026-11-29 evening, device call D (nvidia-h200; carry [".whl", ".peer"]; <= 8 minutes): issue 57 item 1 on the final
# source (main 366464e: both key lists of a sparse plan merged in one combine): FlashMLA's whole sparse-decoding test
# through mla_dispatch.compat.flash_mla on cuda_sm90, 16 shards side by side on the one GPU, then every case that
# failed there again alone (16 processes at once ran 5 cases out of GPU memory in call C).
SECONDS=0
stamp() { echo "[e1D ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L /tmp/sparse /tmp/sparse_alone
source ci/gpu_setup.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $?"; tail -n 1 $L/ext_build.log
stamp "FlashMLA sparse decoding test, 16 shards"
OUT=/tmp/sparse SHARD_TIMEOUT=$((400 - SECONDS)) bash dev/flashmla_sparse_all.sh .peer/flashmla/tests cuda_sm90 0 15 16 \
  > $L/sparse_all.log 2>&1
echo "sparse exit $?"; tail -n 1 $L/sparse_all.log
stamp "the failed cases again, alone"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout $((470 - SECONDS)) python dev/flashmla_test.py sparse \
  .peer/flashmla/tests --backend cuda_sm90 --cases "/tmp/sparse/flashmla_sparse_cuda_sm90_*of16.json" \
  --json /tmp/sparse_alone/rerun.json > $L/sparse_alone.log 2>&1; echo "alone exit $?"; tail -n 1 $L/sparse_alone.log
stamp "end"
tar -czf $OUT/e1D.tar.gz -C /tmp logs sparse sparse_alone 2>/dev/null; ls -l $OUT
