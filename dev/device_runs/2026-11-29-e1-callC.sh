#!/usr/bin/env bash
# 2026-11-29 evening, device call C, run as next-session-call3.sh (nvidia-h200; carry [".whl", ".peer",
# ".gpu_stage"]; <= 9.5 minutes): issue 57 item 1, FlashMLA's own tests/test_flash_mla_sparse_decoding.py, every
# case (its 246 DeepSeek-V3.2 and 4,502 MODEL1 / DeepSeek-V4 ones, never all run), through
# mla_dispatch.compat.flash_mla on cuda_sm90: 16 shards side by side on
# the one GPU (the cases' data and FlashMLA's reference are host-bound), each under SHARD_TIMEOUT. A shard that runs
# out reports what it took; its count tells how to split the next call.
SECONDS=0
stamp() { echo "[next3 ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L /tmp/sparse
source ci/gpu_setup.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $?"
stamp "FlashMLA sparse decoding test, 16 shards"
OUT=/tmp/sparse SHARD_TIMEOUT=$((540 - SECONDS)) bash dev/flashmla_sparse_all.sh .peer/flashmla/tests cuda_sm90 0 15 16 \
  > $L/sparse_all.log 2>&1
echo "sparse exit $?"; tail -n 3 $L/sparse_all.log
stamp "end"
tar -czf $OUT/next3.tar.gz -C /tmp logs sparse 2>/dev/null; ls -l $OUT
