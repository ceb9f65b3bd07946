#!/usr/bin/env bash
# Next session, device call 2 (nvidia-h200; carry [".whl", ".peer", ".gpu_stage"]; <= 9.5 minutes): the hidden-NaN
# fix of issue 59 item 5 (branch wip/hidden-nan-folders, never run on a GPU) against main.
# Stage the branch before the call, from the repository root here:
#   rm -rf .gpu_stage/hidden-nan && mkdir -p .gpu_stage/hidden-nan && \
#     git archive wip/hidden-nan-folders | tar -x -C .gpu_stage/hidden-nan
#   - the branch's extension (its own source hash: main's build is untouched);
#   - on the branch: tests/test_causal_tail.py (no strict xfails there; every cuda_sm90 mainloop forced on a causal
#     tail, bf16 and fp8_e4m3), test_triton_gpu.py's causal and Gluon cases, test_triton_aot.py, test_cuda_sm90.py -k
#     causal; racecheck of one forced mainloop;
#   - the cost: bench's causal configs (hopper grid, s_q > 1) on main and on the branch, cuda_sm90 and triton.
SECONDS=0
stamp() { echo "[next2 ${SECONDS}s] $*"; }
L=/tmp/logs; mkdir -p $L
source ci/gpu_setup.sh
python -m mla_dispatch build > $L/ext_main.log 2>&1; echo "main build exit $?"
stamp "bench causal configs on main"
timeout 120 python -m mla_dispatch bench --grid hopper --backends cuda_sm90,triton --times graph --rep-ms 30 --quiet \
  --only causal --out /tmp/bench_main > $L/bench_main.log 2>&1; echo "bench main exit $?"; tail -n 14 $L/bench_main.log
cd .gpu_stage/hidden-nan || { echo "no staged branch"; exit 1; }
export PYTHONPATH=$PWD:$PWD/dev:$PYTHONPATH
python -c "import mla_dispatch; print('branch package:', mla_dispatch.__file__)"
python -m mla_dispatch build > $L/ext_branch.log 2>&1; echo "branch build exit $?"; tail -n 2 $L/ext_branch.log
stamp "branch tests"
PYTEST_LIVE_LOG=$L/live_branch.log timeout 240 python -m pytest -q -rfE --tb=short -m gpu -n 8 -p no:cacheprovider \
  -p pytest_live_log tests/test_causal_tail.py tests/test_triton_gpu.py tests/test_triton_aot.py \
  "tests/test_cuda_sm90.py" -k "causal or tail or gluon or seesaw or aot" > $L/branch_tests.log 2>&1
echo "branch tests exit $?"; tail -n 2 $L/branch_tests.log; grep -E "^(FAILED|ERROR) " $L/live_branch.log | head -30
stamp "bench causal configs on the branch"
timeout 120 python -m mla_dispatch bench --grid hopper --backends cuda_sm90,triton --times graph --rep-ms 30 --quiet \
  --only causal --out /tmp/bench_branch > $L/bench_branch.log 2>&1; echo "bench branch exit $?"
tail -n 14 $L/bench_branch.log
stamp "end"
tar -czf $OUT/next2.tar.gz -C /tmp logs bench_main bench_branch 2>/dev/null; ls -l $OUT
