#!/usr/bin/env bash
# Lead's device call 3 (nvidia-h200): tracebacks of call 2's failures, the GPU tests call 2 had no time for, and the
# flashmla grid again with the shipped H200 table (auto's one 'over' row was the same backend as the fastest).
SECONDS=0
stamp() { echo "[call3 ${SECONDS}s] $*"; }
source ci/gpu_setup.sh
python -m mla_dispatch build 2>&1 | tail -n 1
source ci/flashmla_peer.sh
stamp "GPU tests"
timeout 150 python -m pytest -q -rfE --tb=short -m gpu -n 8 --dist loadgroup -p no:cacheprovider \
  tests/test_stale_plan.py tests/test_batch_invariant.py tests/test_api.py tests/test_gpu_foundation.py \
  tests/test_vendor_flashmla.py tests/test_vendor_flashinfer.py tests/test_integrations_transformers.py \
  tests/test_flashmla_sched.py tests/test_dcp.py tests/test_compat_flash_mla.py tests/test_multi_gpu.py \
  "tests/test_triton_gpu.py::test_triton_gpu_op_under_torch_compile" \
  "tests/test_triton_gpu.py::test_triton_gpu_matches_reference[triton-bf16-fp8_ds_mla-b3xs2xh128-ps64-L300-causal]" \
  "tests/test_causal_tail.py::test_gpu_backends_keep_hidden_keys_out[b3xs3xh4-ps16-triton-bf16]" \
  -k "not grid_gpu and not nccl" > $OUT/gpu_tests3.log 2>&1
echo "tests exit $?"; grep -E "^FAILED|^ERROR| passed| failed" $OUT/gpu_tests3.log | head -40
stamp "flashmla grid, shipped table"
python -c 'from mla_dispatch.dispatch import tuned; from mla_dispatch.dispatch.platform import detect_platform; print("auto orders by:", tuned.active_table_description(detect_platform()))'
mkdir -p /tmp/b3
timeout $((560 - SECONDS)) python -m mla_dispatch bench --grid flashmla --backends auto,cuda_sm90,flashmla,flashinfer,triton --times graph --rep-ms 40 --quiet --out /tmp/b3 > /tmp/b3/flashmla.log 2>&1
echo "bench exit $?"
python -m mla_dispatch bench --check-auto 0.03 --from-json /tmp/b3/bench-flashmla.json 2>&1 | tail -n 22
cp /tmp/b3/bench-flashmla.json /tmp/b3/flashmla.log $OUT/ 2>/dev/null
stamp "end"
