#!/usr/bin/env bash
# Session of 2026-11-29 (night), device call 3 (nvidia-h200; carry [".whl", ".peer"]; <= 3 minutes: what was left of
# the session's device time). Issue 55:
#   - host cost after the split-KV plans' buffer pool (a dropped plan's buffers go to the next plan of its layout):
#     cuda_sm90, triton and our FlashMLA adapter, FlashMLA's whole call beside them;
#   - the transformers integration's decode step: synchronising CUDA calls per call site and a cProfile, stock eager
#     beside cuda_sm90 (dev/integration_profile.py; prompt 1024, b = 1).
SECONDS=0
stamp() { echo "[n3 ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L /tmp/host_cost /tmp/iprof
source ci/gpu_setup.sh; source ci/flashmla_peer.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $?"; tail -n 1 $L/ext_build.log
stamp "host cost"
timeout 50 python dev/host_cost.py --backends cuda_sm90,triton,flashmla --reps 20 --out /tmp/host_cost \
  > $L/host_cost.log 2>&1; echo "host cost exit $?"; tail -n 12 $L/host_cost.log
stamp "integration profile"
timeout $((165 - SECONDS)) python dev/integration_profile.py --backends stock:eager,cuda_sm90 --prompt 1024 --new 8 \
  --out /tmp/iprof > $L/iprof.log 2>&1; echo "iprof exit $?"; tail -n 20 $L/iprof.log
stamp "end"
tar -czf $OUT/n3.tar.gz -C /tmp logs host_cost iprof 2>/dev/null; ls -l $OUT
