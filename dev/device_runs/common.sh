#!/usr/bin/env bash
# The set-up every device call here repeats, for new scripts to source from the repository root:
#   TAG=s8c1 source dev/device_runs/common.sh
# Logs go straight to $OUT, so a call cut short by its time limit still returns what it wrote: run.log (stamps, the
# device, the versions) and ext_build.log (its line names the extension's source hash, the build key). The device's
# copy of the tree may carry a stale .git, so no commit is logged: the calling script's record says which main ran.
# stamp MSG: a line of run.log (and stdout) with the seconds since the start.
SECONDS=0
stamp() { echo "[${TAG:-run} ${SECONDS}s] $*" | tee -a "$OUT/run.log"; }
source ci/gpu_setup.sh >> "$OUT/run.log" 2>&1
source ci/flashmla_peer.sh >> "$OUT/run.log" 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/run.log"
python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
  >> "$OUT/run.log"
python -m mla_dispatch build > "$OUT/ext_build.log" 2>&1
stamp "build exit $?: $(tail -n 1 "$OUT/ext_build.log")"
