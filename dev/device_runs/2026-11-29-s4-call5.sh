#!/usr/bin/env bash
# 2026-11-29 (session 4), device call 5 (nvidia-h200; carry [".whl"]; <= 4 minutes): racecheck of etap's sparse
# instances (the per-tile "has an id" flags in shared memory and the ids' prefetch share the dense instances' barrier
# protocol), fp8_ds_mla and fp8_ds_v4, the plan's choice and etap forced (row tiles); final source.
SECONDS=0
L=/tmp/logs; mkdir -p $L
source ci/gpu_setup.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $?"; tail -n 1 $L/ext_build.log
for fmt in fp8_ds_mla fp8_ds_v4; do
  timeout 100 compute-sanitizer --tool racecheck --racecheck-report hazard python ci/sm90_sanitize.py --variants 6 \
    --kv-format $fmt --sparse 256 > $L/racecheck_$fmt.log 2>&1; echo "racecheck $fmt exit $? (${SECONDS}s)"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard" $L/racecheck_$fmt.log | tail -n 3
done
tar -czf $OUT/s4c5.tar.gz -C /tmp logs 2>/dev/null; ls -l $OUT
