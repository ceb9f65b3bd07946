#!/usr/bin/env bash
# Session 3, device call 4 (nvidia-h200): the changes since call 3 on the GPU: FlashInfer's page lists in one Triton
# launch and its wrapper pool (test_page_lists, test_vendor_flashinfer, test_stale_plan, compat's reused metadata),
# the split-KV plan's single allocation (test_cuda_sm90.py, test_split_plan, test_triton_gpu), the torch.compile
# launch's defaulted arguments, FlashMLA's schedule test without its pad column; quick conformance; then
# dev/host_cost.py. Live log of every test (dev/pytest_live_log.py); one tar back.
SECONDS=0
stamp() { echo "[s3c4 ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L
tar -xJf .gpu_stage/fa3_built.tar.xz -C .peer/flash-attention/hopper
source ci/gpu_setup.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; tail -n 1 $L/ext_build.log
source ci/flashmla_peer.sh; source ci/fa3_peer.sh
export PYTHONPATH=dev:$PYTHONPATH PYTEST_LIVE_LOG=$L/live.log
stamp "GPU tests of the changes"
timeout 230 python -m pytest -q -rfE --tb=short -m gpu -n 8 --dist loadgroup -p no:cacheprovider -p pytest_live_log \
  tests/test_page_lists.py tests/test_vendor_flashinfer.py tests/test_stale_plan.py tests/test_flashmla_sched.py \
  tests/test_split_plan.py tests/test_triton_gpu.py tests/test_cuda_sm90.py tests/test_batch_invariant.py \
  "tests/test_compat_flash_mla.py::test_reused_meta_reads_every_per_call_argument_gpu" \
  > $L/tests.log 2>&1
echo "tests exit $?"; tail -n 2 $L/tests.log
grep -E "^(FAILED|ERROR) " $L/live.log | head -30
stamp "conformance --quick"
timeout 60 python -m mla_dispatch conformance --quick --backends cuda_sm90,triton,flashinfer,flashmla,fa3 --quiet > $L/conformance.log 2>&1
echo "conformance exit $?"; tail -n 3 $L/conformance.log
stamp "host cost"
left=$((440 - SECONDS)); [ $left -gt 150 ] && left=150
[ $left -gt 30 ] && timeout $left python dev/host_cost.py --reps 30 --out /tmp/host_cost > $L/host_cost.log 2>&1
echo "host_cost exit $?"; tail -n 16 $L/host_cost.log
stamp "end"
tar -czf $OUT/call4.tar.gz -C /tmp logs host_cost 2>/dev/null
