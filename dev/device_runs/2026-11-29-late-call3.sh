#!/usr/bin/env bash
# 2026-11-29 late night, device call 3 (nvidia-h200; carry [".whl", ".peer"]; <= 9.5 minutes), issues 55 and 57:
#   - the triton backend's bound eager path with CUDA graphs per argument key (metadata/launch_graphs.py), the
#     transformers integration's per-layer CUDA graphs (enable(cuda_graphs=True)), triton sparse pages past 256:
#     their GPU tests and the triton GPU suite, with the GPU tests of the evening's post-call changes;
#   - FlashMLA's sparse cases triton declined in call 2 (pages of 576 tokens) and a second sample of 40 (seed 1);
#   - dev/plan_cost_probe.py, dev/host_cost.py (triton with and without launch graphs beside cuda_sm90 and
#     FlashMLA), the transformers e2e at 1K with and without graphs.
SECONDS=0
stamp() { echo "[late3 ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L /tmp/host_cost /tmp/e2e /tmp/sparse_triton
source ci/gpu_setup.sh; source ci/flashmla_peer.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $?"; tail -n 1 $L/ext_build.log
export PYTHONPATH=dev:$PYTHONPATH
stamp "GPU tests of the change"
PYTEST_LIVE_LOG=$L/live.log timeout 170 python -m pytest -q -rfE --tb=short -m gpu -n 8 -p no:cacheprovider \
  -p pytest_live_log tests/test_launch_graphs.py tests/test_integrations_transformers.py tests/test_triton_gpu.py \
  tests/test_launch_records.py tests/test_host_path.py tests/test_stale_plan.py tests/test_api.py \
  tests/test_vendor_flashinfer.py tests/test_page_lists.py tests/test_split_plan.py tests/test_triton_launch.py \
  > $L/tests.log 2>&1
echo "tests exit $?"; tail -n 2 $L/tests.log; grep -E "^(FAILED|ERROR|XPASS)" $L/live.log | head -20
stamp "FlashMLA sparse on triton: call 2's declined cases, then a sample of 40 (seed 1)"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 100 python dev/flashmla_test.py sparse .peer/flashmla/tests \
  --backend triton --cases benchmarks/h200-flashmla-sparse-triton-sample-76f4905.json \
  --json /tmp/sparse_triton/rerun.json > $L/sparse_rerun.log 2>&1; echo "rerun exit $?"; tail -n 1 $L/sparse_rerun.log
stamp "plan cost probe"
timeout 40 python dev/plan_cost_probe.py --reps 40 > $L/probe.log 2>&1; echo "probe exit $?"; tail -n 3 $L/probe.log
stamp "host cost"
timeout 110 python dev/host_cost.py --reps 30 --backends cuda_sm90,triton,triton/launch_graphs=False,flashmla \
  --out /tmp/host_cost --no-profile > $L/host_cost.log 2>&1; echo "host cost exit $?"; tail -n 22 $L/host_cost.log
stamp "transformers e2e, prompt 1024"
timeout $((500 - SECONDS)) python dev/e2e_transformers.py \
  --backends stock:eager,cuda_sm90,cuda_sm90+graphs,triton+graphs --batch 1,8 --prompt 1024 --new 32 --repeats 3 \
  --host-time --json /tmp/e2e/e2e-1024.json > $L/e2e-1024.log 2>&1
echo "e2e exit $?"; grep -v "it/s\]" $L/e2e-1024.log | tail -n 10
stamp "FlashMLA sparse on triton, a sample of 40 (seed 1)"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout $((565 - SECONDS)) python dev/flashmla_test.py sparse \
  .peer/flashmla/tests --backend triton --sample 40 --seed 1 --json /tmp/sparse_triton/sample-seed1.json \
  > $L/sparse_sample.log 2>&1; echo "sample exit $?"; tail -n 1 $L/sparse_sample.log
stamp "end"
tar -czf $OUT/late3.tar.gz -C /tmp logs host_cost e2e sparse_triton 2>/dev/null; ls -l $OUT
