#!/usr/bin/env bash
# Is `auto` right on this GPU? One device command (<= 9 minutes), for issue 56's record in benchmarks/RESULTS.md:
#   1. FlashMLA (built from .peer/flashmla in the background, or its carried prebuilt .so) and our extension;
#   2. `tune --quick`, what the README tells a user of an unlisted GPU to run, measures this device (at most 120 s of
#      measuring) and writes its table to $OUT/<device>.json (commit it to mla_dispatch/dispatch/tables/ to
#      ship it); H200_AUTO_TUNE=full measures the full tuning grid instead, within the same budget;
#   3. `bench` on the flashmla, heads, latency and pages grids, one grid per process, every available backend and
#      FlashMLA's own call beside `auto`, with that table in use (CUDA-graph replays only);
#   4. `bench --check-auto 0.03` over the four runs, printed last: auto against the fastest correct backend, both
#      timed again in alternation per config (5 rounds) by each grid's run.
# Carry ".whl" (flashinfer-python 0.6.0), ".peer" (FlashMLA's source, ci/flashmla_peer.sh) and, for FA3, ".gpu_stage",
# then:
#   bash ci/h200_auto.sh
# Every phase prints its start time in seconds since the start; the python steps run under `timeout` so the command
# ends by H200_AUTO_LIMIT_S (default 530) with what it has written; grids that no longer fit are skipped, and said.
OUT=${OUT:-gpu_out}
# everything is written under W and packed at the end into $OUT/h200_auto.tar.gz, with the table and the verdict beside
# it: the device tool brings back at most 8 files from $OUT (a run that wrote ~20 there lost its table)
W=${H200_AUTO_WORK:-/tmp/h200_auto}; rm -rf "$W"; mkdir -p "$W/tables" "$W/bench" "$OUT"
trap 'tar -czf "$OUT/h200_auto.tar.gz" -C "$W" . && cp "$W"/tables/*.json "$OUT/" 2>/dev/null;
      cp "$W/check_auto.txt" "$OUT/" 2>/dev/null; ls -l "$OUT"' EXIT
LIMIT=${H200_AUTO_LIMIT_S:-530}
REP_MS=${H200_AUTO_REP_MS:-100}  # do_bench budget per measurement in the bench (bench's default; the H100 auto run used 40)
TUNE_REP_MS=${H200_AUTO_TUNE_REP_MS:-25}
GRIDS=(flashmla heads latency pages)
SECONDS=0
stamp() { echo "[h200_auto ${SECONDS}s] $*"; }
left() { echo $((LIMIT - SECONDS)); }

source ci/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$W/device.txt"
if [ -d .peer/flashmla ] && ! grep -qs sparse_decode_fwd .peer/flashmla/flash_mla/cuda*.so; then
  stamp "building FlashMLA in the background (log: $W/flashmla_build.log)"
  rm -f .peer/flashmla/flash_mla/cuda*.so
  bash ci/build_flashmla_peer.sh .peer/flashmla > "$W/flashmla_build.log" 2>&1 &
  FLASHMLA_BUILD=$!
fi
stamp "building our extension"
python -m mla_dispatch build 2>&1 | tail -n 3
if [ -n "${FLASHMLA_BUILD:-}" ]; then
  wait "$FLASHMLA_BUILD" || { echo "FlashMLA build failed:"; tail -n 20 "$W/flashmla_build.log"; }
fi
# with its .so in place flashmla_peer.sh only puts FlashMLA on the path (it would rebuild a missing one)
if ls .peer/flashmla/flash_mla/cuda*.so >/dev/null 2>&1; then source ci/flashmla_peer.sh; fi
# FlashAttention-3 beside them where its build is in place (ci/fa3_peer.sh; it would build a missing one: ~5 min), or
# carried prebuilt in .gpu_stage/fa3_built.tar.xz (its hopper/ files; carry ".gpu_stage" too)
if [ -f .gpu_stage/fa3_built.tar.xz ] && [ -d .peer/flash-attention/hopper ] && \
   ! ls .peer/flash-attention/hopper/flash_attn_3/_C*.so >/dev/null 2>&1; then
  tar -xJf .gpu_stage/fa3_built.tar.xz -C .peer/flash-attention/hopper
fi
if ls .peer/flash-attention/hopper/flash_attn_3/_C*.so >/dev/null 2>&1; then source ci/fa3_peer.sh; fi
python - <<'PY' | tee "$W/backends.txt"
import mla_dispatch.dispatch.registry as r
for n in r.registered_names():
    reasons = r.get_backend(n).availability_reasons()
    print(f"{n}: {'available' if not reasons else '; '.join(map(str, reasons))}")
PY
grep -q "^flashmla: available" "$W/backends.txt" || echo "WARNING: FlashMLA is not available: the check below is not issue 56's"
grep -q "^flashinfer: available" "$W/backends.txt" || echo "WARNING: flashinfer is not available (carry .whl)"

TABLE="$W/tables/$(python -c 'from mla_dispatch.dispatch import tuned; from mla_dispatch.dispatch.platform import detect_platform; print(tuned.shipped_table_path(detect_platform()).name)')"
BACKENDS=$(python -c 'import mla_dispatch.dispatch.registry as r; print(",".join(n for n in ("cuda_sm90", "flashmla", "fa3", "flashinfer", "triton") if not r.get_backend(n).availability_reasons()))')
# the tune budget: what is left after the benches' share (150 s for the four grids: an estimate from counting configs x
# backends x do_bench budgets, to be replaced by the phase times this run prints), at most 120 s and at least 30 s
BUDGET=$(( $(left) - 150 )); [ "$BUDGET" -gt 120 ] && BUDGET=120; [ "$BUDGET" -lt 30 ] && BUDGET=30
QUICK=--quick; [ "${H200_AUTO_TUNE:-quick}" = full ] && QUICK=
stamp "tune ${QUICK:-(full grid)} on $BACKENDS, budget ${BUDGET}s -> $TABLE"
timeout "$(left)" python -m mla_dispatch tune $QUICK --backends "$BACKENDS" --metric graph --rep-ms "$TUNE_REP_MS" \
  --budget-s "$BUDGET" --quiet --out "$TABLE" 2>&1 | tee "$W/tune.log" | tail -n 60
[ -f "$TABLE" ] || { echo "tune wrote no table: see $W/tune.log"; exit 1; }

export MLA_DISPATCH_TUNED_TABLE=$TABLE
python -c 'from mla_dispatch.dispatch import tuned; from mla_dispatch.dispatch.platform import detect_platform; print("auto orders by:", tuned.active_table_description(detect_platform()))'
JSONS=()
for grid in "${GRIDS[@]}"; do
  if [ "$(left)" -lt 45 ]; then stamp "SKIPPED grid $grid: $(left)s left"; continue; fi
  stamp "bench $grid"
  # --check-auto: auto and each config's fastest backend are timed again in alternation (their medians are judged)
  timeout "$(left)" python -m mla_dispatch bench --grid "$grid" --backends "auto,$BACKENDS" --times graph \
    --rep-ms "$REP_MS" --check-auto 0.03 --quiet --out "$W/bench" > "$W/bench/$grid.log" 2>&1
  echo "  exit $?; $(grep -c '' "$W/bench/$grid.log") lines in $W/bench/$grid.log"
  [ -f "$W/bench/bench-$grid.json" ] && JSONS+=(--from-json "$W/bench/bench-$grid.json")
done
stamp "done measuring"
[ ${#JSONS[@]} -gt 0 ] || { echo "no bench output"; exit 1; }
python -m mla_dispatch bench --check-auto 0.03 "${JSONS[@]}" 2>&1 | tee "$W/check_auto.txt"
