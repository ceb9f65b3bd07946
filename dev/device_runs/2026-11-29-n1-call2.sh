#!/usr/bin/env bash
# Session of 2026-11-29 (night), device call 2 (nvidia-h200; carry [".whl", ".peer", ".gpu_stage"]; <= 9.5 minutes).
#   - issue 55's host cost on main (dev/host_cost.py: plan, update, run, one-shot, cProfiles beside the JSON);
#   - the transformers integration end to end (issue 55 item 4's targets): stock eager, stock sdpa, cuda_sm90 and
#     triton at prompts 1K and 8K, b = 1 and 8, 32 decode steps, with each attention layer's host time per step;
#   - the hidden-NaN fix's cost (issue 59 item 5): bench's causal configs (hopper grid) on main, then on the branch
#     (staged in .gpu_stage/hidden-nan as call 1 says), cuda_sm90 and triton, CUDA-graph times.
SECONDS=0
stamp() { echo "[n2 ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L /tmp/host_cost /tmp/e2e
source ci/gpu_setup.sh; source ci/flashmla_peer.sh
python -m mla_dispatch build > $L/ext_main.log 2>&1; echo "main build exit $?"; tail -n 1 $L/ext_main.log
stamp "host cost"
timeout 120 python dev/host_cost.py --reps 20 --out /tmp/host_cost > $L/host_cost.log 2>&1; echo "host cost exit $?"
tail -n 16 $L/host_cost.log
for prompt in 1024 8192; do
  stamp "transformers e2e, prompt $prompt"
  timeout 100 python dev/e2e_transformers.py --backends stock:eager,stock:sdpa,cuda_sm90,triton --batch 1,8 \
    --prompt $prompt --new 32 --repeats 3 --host-time --json /tmp/e2e/e2e-$prompt.json > $L/e2e-$prompt.log 2>&1
  echo "e2e $prompt exit $?"; grep -v "it/s\]" $L/e2e-$prompt.log | tail -n 12
done
stamp "bench causal configs on main"
timeout 70 python -m mla_dispatch bench --grid hopper --backends cuda_sm90,triton --times graph --rep-ms 20 --quiet \
  --only causal --out /tmp/bench_main > $L/bench_main.log 2>&1; echo "bench main exit $?"; tail -n 12 $L/bench_main.log
cd .gpu_stage/hidden-nan || { echo "no staged branch"; exit 1; }
export PYTHONPATH=$PWD:$PWD/dev:$PYTHONPATH
python -c "import mla_dispatch; print('package:', mla_dispatch.__file__)"
python -m mla_dispatch build > $L/ext_branch.log 2>&1; echo "branch build exit $?"; tail -n 1 $L/ext_branch.log
stamp "bench causal configs on the branch"
timeout $((545 - SECONDS)) python -m mla_dispatch bench --grid hopper --backends cuda_sm90,triton --times graph \
  --rep-ms 20 --quiet --only causal --out /tmp/bench_branch > $L/bench_branch.log 2>&1; echo "bench branch exit $?"
tail -n 12 $L/bench_branch.log
stamp "end"
tar -czf $OUT/n2.tar.gz -C /tmp logs host_cost e2e bench_main bench_branch 2>/dev/null; ls -l $OUT
