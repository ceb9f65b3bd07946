#!/usr/bin/env bash
# 2026-11-29 late night, device call 3 (nvidia-h200; carry [".whl", ".peer"]; <= 9.5 minutes), issue 55's Triton launch:
#   - the triton backend's bound eager path and its CUDA graphs per argument key (metadata/launch_graphs.py), and a
#     plan whose state is replaced rebinding that path: their GPU tests and the triton GPU suite;
#   - the GPU tests of what the evening session built after its last call (next-session-call1.sh's first list);
#   - dev/plan_cost_probe.py (where triton's plan time goes beyond cProfile) and dev/host_cost.py with the triton
#     backend with and without launch graphs beside cuda_sm90 and FlashMLA; the transformers e2e at 1K on triton.
SECONDS=0
stamp() { echo "[late3 ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L /tmp/host_cost /tmp/e2e
source ci/gpu_setup.sh; source ci/flashmla_peer.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $?"; tail -n 1 $L/ext_build.log
export PYTHONPATH=dev:$PYTHONPATH
stamp "GPU tests of the change"
PYTEST_LIVE_LOG=$L/live.log timeout 170 python -m pytest -q -rfE --tb=short -m gpu -n 8 -p no:cacheprovider \
  -p pytest_live_log tests/test_launch_graphs.py tests/test_triton_gpu.py tests/test_launch_records.py \
  tests/test_host_path.py tests/test_stale_plan.py tests/test_api.py tests/test_ds_v4.py tests/test_vendor_flashinfer.py \
  tests/test_page_lists.py tests/test_integrations_transformers.py tests/test_split_plan.py tests/test_triton_launch.py \
  > $L/tests.log 2>&1
echo "tests exit $?"; tail -n 2 $L/tests.log; grep -E "^(FAILED|ERROR|XPASS)" $L/live.log | head -20
stamp "plan cost probe"
timeout 40 python dev/plan_cost_probe.py --reps 40 > $L/probe.log 2>&1; echo "probe exit $?"; cat $L/probe.log | tail -n 4
stamp "host cost"
timeout 120 python dev/host_cost.py --reps 30 --backends cuda_sm90,triton,triton/launch_graphs=False,flashmla \
  --out /tmp/host_cost > $L/host_cost.log 2>&1; echo "host cost exit $?"; tail -n 22 $L/host_cost.log
stamp "transformers e2e, prompt 1024, triton"
timeout $((540 - SECONDS)) python dev/e2e_transformers.py --backends stock:eager,triton,cuda_sm90 --batch 1,8 \
  --prompt 1024 --new 32 --repeats 3 --host-time --json /tmp/e2e/e2e-1024.json > $L/e2e-1024.log 2>&1
echo "e2e exit $?"; grep -v "it/s\]" $L/e2e-1024.log | tail -n 10
stamp "end"
tar -czf $OUT/late3.tar.gz -C /tmp logs host_cost e2e 2>/dev/null; ls -l $OUT
