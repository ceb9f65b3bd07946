#!/usr/bin/env bash
# 2026-11-29 (session 4), device call 6 (nvidia-h200; carry [".whl"]; <= 4 minutes): call 5's racecheck printed 100
# of 1,232 / 1,120 reports. Every report this time (--print-limit), grouped by the source lines of the write and the
# read, for etap's sparse instance and, as the control, its dense fp8_ds_mla instance on the same script's shapes.
SECONDS=0
L=/tmp/logs; mkdir -p $L
source ci/gpu_setup.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $?"; tail -n 1 $L/ext_build.log
run() {  # name, sm90_sanitize arguments
  local name=$1; shift
  timeout 110 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 100000 \
    python ci/sm90_sanitize.py "$@" > $L/racecheck_$name.log 2>&1; echo "racecheck $name exit $? (${SECONDS}s)"
  grep -E "RACECHECK SUMMARY" $L/racecheck_$name.log
  python3 - "$L/racecheck_$name.log" <<'PY'
import collections, re, sys
pairs, write = collections.Counter(), None
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"(Write|Read) Thread .* in (\S+:\d+)", line)
    if not m:
        continue
    if m.group(1) == "Write":
        write = m.group(2)
    else:
        pairs[(write, m.group(2))] += 1
for (w, r), n in pairs.most_common():
    print(f"  {n:6d}  write {w}  read {r}")
PY
}
run sparse_ds_mla --variants 6 --kv-format fp8_ds_mla --sparse 256
run dense_ds_mla --variants 6 --kv-format fp8_ds_mla
tar -czf $OUT/s4c6.tar.gz -C /tmp logs 2>/dev/null; ls -l $OUT
