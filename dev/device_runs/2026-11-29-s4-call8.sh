#!/usr/bin/env bash
# 2026-11-29 (session 4), device call 8 (nvidia-h200; carry [".whl", ".peer"]; <= 3.5 minutes): the combine launched
# with programmatic stream serialization behind the decode (each decode kernel allows it at its start, the combine
# waits for the decode first): call 7 showed our decode + combine kernels at b=8 summing to ~61 us of a 66 us graph
# replay, FlashMLA's to ~54 us of 50.6 (its combine overlaps its decode's tail). cuda_sm90's GPU tests, then the hopper
# grid beside FlashMLA.
SECONDS=0
L=/tmp/logs; mkdir -p $L /tmp/bench
source ci/gpu_setup.sh; source ci/flashmla_peer.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $?"; tail -n 1 $L/ext_build.log
timeout 120 python -m pytest -q -rfE --tb=short -m gpu -n 8 -p no:cacheprovider tests/test_cuda_sm90.py \
  > $L/gpu_cuda_sm90.log 2>&1; echo "cuda_sm90 tests exit $? (${SECONDS}s)"; tail -n 1 $L/gpu_cuda_sm90.log
grep -E "^(FAILED|ERROR)" $L/gpu_cuda_sm90.log | head -10
timeout 70 python -m mla_dispatch bench --grid hopper --backends cuda_sm90,flashmla --times graph --out /tmp/bench \
  --quiet > $L/bench_hopper.log 2>&1; echo "bench exit $? (${SECONDS}s)"
grep -E "^\| b" $L/bench_hopper.log | grep -v "flashmla |" | cut -d'|' -f2,3,7,8
tar -czf $OUT/s4c8.tar.gz -C /tmp logs bench 2>/dev/null; ls -l $OUT
