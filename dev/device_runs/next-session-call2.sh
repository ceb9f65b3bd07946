#!/usr/bin/env bash
# Next session, device call 2 (nvidia-h200; carry [".whl", ".peer"]; <= 9.5 minutes): issue 55's measurements on
# the final source, to resolve it or say blocked with the profiles:
#   - dev/host_cost.py (every backend; the JSON and each row written as it is measured);
#   - the transformers integration: e2e at prompts 1K and 8K, b = 1 and 8, with per-layer host time, and
#     dev/integration_profile.py (synchronising calls per call site, cProfile) after the pinned copies.
SECONDS=0
stamp() { echo "[next2 ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L /tmp/host_cost /tmp/e2e /tmp/iprof
source ci/gpu_setup.sh; source ci/flashmla_peer.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $?"; tail -n 1 $L/ext_build.log
stamp "host cost"
timeout 180 python dev/host_cost.py --reps 30 --out /tmp/host_cost > $L/host_cost.log 2>&1; echo "host cost exit $?"
tail -n 16 $L/host_cost.log
for prompt in 1024 8192; do
  stamp "transformers e2e, prompt $prompt"
  timeout 110 python dev/e2e_transformers.py --backends stock:eager,stock:sdpa,cuda_sm90,triton --batch 1,8 \
    --prompt $prompt --new 32 --repeats 3 --host-time --json /tmp/e2e/e2e-$prompt.json > $L/e2e-$prompt.log 2>&1
  echo "e2e $prompt exit $?"; grep -v "it/s\]" $L/e2e-$prompt.log | tail -n 12
done
stamp "integration profile"
timeout $((560 - SECONDS)) python dev/integration_profile.py --backends stock:eager,cuda_sm90,triton --prompt 1024 \
  --new 8 --out /tmp/iprof > $L/iprof.log 2>&1; echo "iprof exit $?"; tail -n 24 $L/iprof.log
stamp "end"
tar -czf $OUT/next2.tar.gz -C /tmp logs host_cost e2e iprof 2>/dev/null; ls -l $OUT
