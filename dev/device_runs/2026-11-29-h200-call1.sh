#!/usr/bin/env bash
# Lead's device call 1 (nvidia-h200): FA3 peer build in the background (CPU); our extension; the GPU suite on the
# merged main; conformance; FA3's tests and conformance once built; the host-cost table.
SECONDS=0
stamp() { echo "[call1 ${SECONDS}s] $*"; }
export OUT
source ci/gpu_setup.sh
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee $OUT/device.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee -a $OUT/device.txt
( SECONDS=0; MAX_JOBS=8 bash ci/build_fa3_peer.sh .peer/flash-attention > $OUT/fa3_build.log 2>&1; echo "fa3 build rc=$? in ${SECONDS}s" >> $OUT/fa3_build.log; touch /tmp/fa3_done ) &
stamp "building our extension"
( time python -m mla_dispatch build ) > $OUT/ext_build.log 2>&1; tail -n 4 $OUT/ext_build.log
source ci/flashmla_peer.sh
stamp "GPU suite"
timeout 270 python -m pytest -q -rs -m gpu -n 8 --dist loadgroup -p no:cacheprovider -k "not grid_gpu and not nccl" tests > $OUT/gpu_suite.log 2>&1
echo "suite exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_suite.log | head -40
stamp "conformance flashmla,triton,cuda_sm90,flashinfer"
timeout 80 python -m mla_dispatch conformance --backends flashmla,triton,cuda_sm90,flashinfer --quiet --json $OUT/conformance.json > $OUT/conformance.log 2>&1
echo "conformance exit $?"; tail -n 22 $OUT/conformance.log
stamp "waiting for FA3"
while [ ! -f /tmp/fa3_done ] && [ $SECONDS -lt 420 ]; do sleep 3; done
tail -n 3 $OUT/fa3_build.log
mkdir -p $OUT/fa3so; cp .peer/flash-attention/hopper/flash_attn_3/_C*.so .peer/flash-attention/hopper/flash_attn_config.py $OUT/fa3so/ 2>/dev/null
if ls .peer/flash-attention/hopper/flash_attn_3/_C*.so >/dev/null 2>&1; then
  source ci/fa3_peer.sh
  stamp "fa3 tests + conformance"
  timeout 60 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_vendor_fa3.py > $OUT/fa3_tests.log 2>&1; echo "fa3 tests exit $?"; tail -n 5 $OUT/fa3_tests.log
  timeout 60 python -m mla_dispatch conformance --backends fa3 --quiet --json $OUT/conformance_fa3.json > $OUT/conformance_fa3.log 2>&1; echo "fa3 conformance exit $?"; tail -n 14 $OUT/conformance_fa3.log
fi
left=$((585 - SECONDS))
stamp "host cost (${left}s left)"
[ $left -gt 40 ] && timeout $left python dev/host_cost.py --reps 30 --out $OUT/host_cost > $OUT/host_cost.log 2>&1
echo "host_cost exit $?"; tail -n 30 $OUT/host_cost.log
stamp "end"
