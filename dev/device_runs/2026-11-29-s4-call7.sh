#!/usr/bin/env bash
# 2026-11-29 (session 4), device call 7 (nvidia-h200; carry [".whl", ".peer"]; <= 4 minutes): issue 54's small-batch
# rows (b=8 L-bar 8K and b=32 L-bar 4K, h_q=128: 1.31x / 1.39x FlashMLA's graph time) split into kernels: every kernel
# of dev/ncu_vs_flashmla.py (FlashMLA's call twice, then ours twice) with its duration (ncu, --clock-control none).
SECONDS=0
L=/tmp/logs; mkdir -p $L /tmp/ncu
source ci/gpu_setup.sh; source ci/flashmla_peer.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $?"; tail -n 1 $L/ext_build.log
for cfg in 8,1,128,8192 32,1,128,4096; do
  timeout 80 ncu --clock-control none --section SpeedOfLight --section LaunchStats -c 40 --csv --page details \
    python dev/ncu_vs_flashmla.py --config $cfg > /tmp/ncu/kernels-${cfg//,/-}.csv 2> $L/ncu-${cfg//,/-}.log
  echo "ncu $cfg exit $? (${SECONDS}s)"
  python3 - /tmp/ncu/kernels-${cfg//,/-}.csv <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
cols = rows[head]
seen = {}
for r in rows[head + 1:]:
    d = dict(zip(cols, r))
    key = (int(d["ID"]), d["Kernel Name"])
    if d["Metric Name"] in ("Duration", "Grid Size", "Block Size"):
        seen.setdefault(key, {})[d["Metric Name"]] = d["Metric Value"] + " " + d["Metric Unit"]
for (i, name), m in sorted(seen.items()):
    print(f"  {i:3d} {m.get('Duration', ''):>14s}  grid {m.get('Grid Size', ''):>8s} block {m.get('Block Size', ''):>6s}  {name[:90]}")
PY
done
tar -czf $OUT/s4c7.tar.gz -C /tmp logs ncu 2>/dev/null; ls -l $OUT
