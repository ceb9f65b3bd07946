#!/usr/bin/env bash
# 2026-11-29 evening, device call B2 (nvidia-h200, the machine of call B still warm; carry [".whl", ".peer"]):
# the transformers integration end to end (issue 55's last targets) at prompts 1K and 8K, b = 1 and 8, with the
# per-layer host time, on the final source.
SECONDS=0
stamp() { echo "[e1B2 ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L /tmp/e2e
source ci/gpu_setup.sh
python -m mla_dispatch build > $L/ext_build2.log 2>&1; echo "build exit $?"
for prompt in 1024 8192; do
  stamp "transformers e2e, prompt $prompt"
  timeout 110 python dev/e2e_transformers.py --backends stock:eager,stock:sdpa,cuda_sm90,triton --batch 1,8 \
    --prompt $prompt --new 32 --repeats 3 --host-time --json /tmp/e2e/e2e-$prompt.json > $L/e2e-$prompt.log 2>&1
  echo "e2e $prompt exit $?"; grep -v "it/s\]" $L/e2e-$prompt.log | tail -n 12
done
stamp "end"
tar -czf $OUT/e1B2.tar.gz -C /tmp logs e2e 2>/dev/null; ls -l $OUT
