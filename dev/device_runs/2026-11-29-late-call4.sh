#!/usr/bin/env bash
# 2026-11-29 late night, device call 4 (nvidia-h200; carry [".whl", ".peer"]; <= 9.5 minutes), the session's final
# source: the GPU suite; dev/host_cost.py with every in-house backend, FlashInfer and FlashMLA and the cProfiles of
# each call (issue 55's evidence); the transformers e2e at 1K and 8K with the per-layer CUDA graphs, the per-layer
# host time and the GPU's own time per step (--gpu-time).
SECONDS=0
stamp() { echo "[late4 ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L /tmp/host_cost /tmp/e2e
source ci/gpu_setup.sh; source ci/flashmla_peer.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $?"; tail -n 1 $L/ext_build.log
export PYTHONPATH=dev:$PYTHONPATH
stamp "the GPU suite"
PYTEST_LIVE_LOG=$L/live.log timeout 265 python -m pytest -q -rfE --tb=short -m gpu -n 8 --dist loadgroup \
  -p no:cacheprovider -p pytest_live_log -k "not grid_gpu and not nccl" --ignore tests/test_causal_tail.py tests \
  > $L/gpu_suite.log 2>&1
echo "suite exit $?"; tail -n 2 $L/gpu_suite.log; grep -E "^(FAILED|ERROR|XPASS)" $L/live.log | head -20
stamp "host cost"
timeout 90 python dev/host_cost.py --reps 30 --backends cuda_sm90,triton,flashinfer,flashmla --out /tmp/host_cost \
  > $L/host_cost.log 2>&1; echo "host cost exit $?"; grep -A 14 "^host µs per call (wall" $L/host_cost.log | tail -n 13
stamp "transformers e2e, prompt 1024"
timeout 130 python dev/e2e_transformers.py --backends stock:eager,stock:sdpa,cuda_sm90+graphs,triton+graphs \
  --batch 1,8 --prompt 1024 --new 32 --repeats 3 --host-time --gpu-time --json /tmp/e2e/e2e-1024.json \
  > $L/e2e-1024.log 2>&1; echo "e2e 1024 exit $?"; grep -v "it/s\]" $L/e2e-1024.log | tail -n 10
stamp "transformers e2e, prompt 8192"
timeout $((560 - SECONDS)) python dev/e2e_transformers.py --backends stock:eager,cuda_sm90+graphs,triton+graphs \
  --batch 1,8 --prompt 8192 --new 32 --repeats 3 --host-time --gpu-time --json /tmp/e2e/e2e-8192.json \
  > $L/e2e-8192.log 2>&1; echo "e2e 8192 exit $?"; grep -v "it/s\]" $L/e2e-8192.log | tail -n 8
stamp "end"
tar -czf $OUT/late4.tar.gz -C /tmp logs host_cost e2e 2>/dev/null; ls -l $OUT
