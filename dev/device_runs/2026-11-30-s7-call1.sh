#!/usr/bin/env bash
# 2026-11-30 (session 7), device call 1 (nvidia-h200; carry [".whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl",
# ".peer/flashmla"]; the session's only call: ~290 s of device time left). Issue 54's small-batch schedule for seesaw
# (overlap_items): the hopper grid's rows where parts hold several items, seesaw forced with and without it beside
# FlashMLA and the plan's choice (every config checked against the reference first), then the seesaw / launch-config
# tests. Logs go straight to $OUT, so a call cut short still returns what it did.
SECONDS=0
stamp() { echo "[s7c1 ${SECONDS}s] $*" | tee -a $OUT/run.log; }
source ci/gpu_setup.sh >> $OUT/run.log 2>&1; source ci/flashmla_peer.sh >> $OUT/run.log 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $OUT/run.log
python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
  >> $OUT/run.log
git log --oneline -1 >> $OUT/run.log 2>&1
python -m mla_dispatch build > $OUT/ext_build.log 2>&1; stamp "build exit $?"
timeout 110 python -m mla_dispatch bench --grid hopper --only "b8-,b32-,b128-s1-h128-L4096v,b64-s1-h64-" \
  --backends flashmla,cuda_sm90,cuda_sm90:variant=5:overlap_items=false,cuda_sm90:variant=5:overlap_items=true \
  --times graph --rep-ms 20 --out $OUT --quiet > $OUT/bench.log 2>&1; stamp "bench exit $?"
timeout 120 python -m pytest -q -rfE --tb=short -n 8 -p no:cacheprovider tests/test_cuda_sm90.py \
  -k "variant5 or bad_block_id or reaches_the_bound or clusters or rejects_bad_arguments" \
  > $OUT/tests.log 2>&1; stamp "tests exit $?"; tail -n 3 $OUT/tests.log >> $OUT/run.log
stamp end
