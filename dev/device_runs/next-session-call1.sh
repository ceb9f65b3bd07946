#!/usr/bin/env bash
# Next session, device call 1 (nvidia-h200; carry [".whl", ".peer"]; <= 4 minutes): the sparse table of issue 57 with
# FlashMLA's sparse kernel beside the 16- and 32-head rows as engines run it there (q padded to 64 heads:
# tools/peers.py, sparse_padded_heads; CPU-tested only when written), and the tests of the bench's peers.
SECONDS=0
L=/tmp/logs; mkdir -p $L /tmp/bench
source ci/gpu_setup.sh; source ci/flashmla_peer.sh
python -m mla_dispatch build > $L/ext_build.log 2>&1; echo "build exit $?"; tail -n 1 $L/ext_build.log
timeout 150 python -m mla_dispatch bench --grid dsv32,dsv4 --backends cuda_sm90,triton,flashmla --times graph \
  --out /tmp/bench --quiet > $L/bench.log 2>&1; echo "bench exit $? (${SECONDS}s)"
grep -E "^\| b128-s2-h(16|32)" $L/bench.log | cut -d'|' -f2,3,4,7,8
tar -czf $OUT/next1.tar.gz -C /tmp logs bench 2>/dev/null; ls -l $OUT
