"""Where one call of the cuda_sm90 kernel spends its time, per CTA and per item (GPU machine; diagnosis).

    python ci/sm90_timeline.py --configs 8x8192,32x4096 --variants default,2,5 [--heads 128] [--combine default]
    python ci/sm90_timeline.py --configs 64x8192 --heads 16,32 --variants 8 --kv-format fp8_e4m3

Builds the diagnosis extension (``MLA_SM90_TIMELINE=1``: thread 0 of each CTA stamps ``%globaltimer`` and
``clock64`` at fixed events, ``kernels/cuda/mla_decode_sm90/timeline.cuh``), runs one eager call per repetition
after an L2 flush (as do_bench measures) and prints, as the median over repetitions, in µs:

- ``entry``: when the CTAs start, from the first CTA's start (min / median / max);
- per item (the first of each CTA apart from the later ones), mean and p90 over CTAs:
  ``meta`` (from the previous item's end, or the CTA's start, to its schedule entry, length and table row read),
  ``load`` (to its Q tile and first KV tiles in shared memory), ``loop`` (its tiles, with the per-tile mean),
  ``store`` (the epilogue: the output or partial rows written);
- ``items done`` / ``grid sync`` (fused combine only) / ``end``: from the first CTA's start (min / median / max).

Thread 0, which stamps, belongs to the first warpgroup: in v5 and v6 an item's ``loop`` ends when that warpgroup's
tiles are done and ``store`` includes waiting for the other; v5's steps are that warpgroup's pairs (v6 has none).
In v7 and v8 the accumulator's first thread stamps the items (``load``: to its first tile's P^T, so the scorer's query
tile and first S^T) and its tiles as steps, and the kernel adds per-CTA totals of where its warpgroups wait
(``COUNTERS``: the producer for a free stage, the scorer for a tile, its query tiles, ...), printed as the median over
CTAs. ``--kv-format fp8_e4m3`` gives those variants their cache.
Times inside a CTA come from clock64 at the SM clock measured over the call (globaltimer ticks are coarse on
some parts); ``entry`` and the ends use globaltimer. The stamps cost a little, so compare these numbers with
each other, not with the benchmark's.
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ["MLA_SM90_TIMELINE"] = "1"  # before the extension is built or loaded

import torch  # noqa: E402

from mla_dispatch import plan_decode  # noqa: E402
from mla_dispatch.kernels.cuda.build import load_sm90  # noqa: E402

from bench_cuda_sm90 import make_inputs  # noqa: E402

ITEMS, ITEM_BASE = 7, 1  # params.h: kTimelineItems, kTimelineItemBase
DONE, GRID_SYNC, END = ITEM_BASE + 4 * ITEMS, ITEM_BASE + 4 * ITEMS + 1, ITEM_BASE + 4 * ITEMS + 2
STEP_BASE, STEPS = END + 1, 64  # kTimelineStepBase, kTimelineSteps: the end of each mainloop step (v2 tile, v5 pair)
COUNTER_BASE = STEP_BASE + STEPS  # kTimelineCounterBase: cycle totals (v7 / v8, mainloop_fp8t.cuh's timeline_count)
COUNTERS = ("producer waits for a free stage", "scorer waits for a tile", "scorer's query tiles",
            "scorer waits for the sums' slot", "accumulator waits for a tile", "accumulator waits for P^T",
            "accumulator's epilogues", "accumulator waits for the sums", "  epilogue: first barrier of a half",
            "  epilogue: O^T into sO", "  epilogue: second barrier", "  epilogue: rows out of sO")
PHASES = ("meta", "load", "loop", "store")


def p90(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else float("nan")


def analyse(tl, items, part_offsets, num_parts):
    """One call's timeline -> {name: value in µs}. ``tl``: int64 [ctas, events, 2] (globaltimer ns, clock64)."""
    live = [c for c in range(tl.shape[0]) if tl[c, 0, 0] != 0 and tl[c, END, 0] != 0]
    gt = tl[..., 0].double()
    ck = tl[..., 1].double()
    t0 = min(gt[c, 0].item() for c in live)
    # SM clock (cycles per ns) over the CTAs' whole lives
    rate = sum((ck[c, END] - ck[c, 0]).item() for c in live) / sum((gt[c, END] - gt[c, 0]).item() for c in live)
    us = 1 / rate / 1e3  # µs per cycle
    first = {ph: [] for ph in PHASES}
    later = {ph: [] for ph in PHASES}
    per_tile, rows, counters = [], [], []
    for c in live:
        part = c % num_parts
        # the kernel numbers a part's items from its first (tiles of 64 tokens, the schedule's chunk)
        its = [items[i] for i in range(part_offsets[part], part_offsets[part + 1])]
        tiles = [-(-(te - tb) // 64) for req, tb, te, _ in its if req >= 0]
        phases, loaded = [], []
        prev = ck[c, 0].item()
        for k, (req, tb, te, _) in enumerate(its[:ITEMS]):
            ev = [ck[c, ITEM_BASE + 4 * k + i].item() for i in range(4)]
            if req < 0 or ev[0] == 0:
                continue
            spans = [(b - a) * us for a, b in zip([prev] + ev[:3], ev)]  # meta, load, loop, store
            for ph, x in zip(PHASES, spans):
                (first if k == 0 else later)[ph].append(x)
            if te > tb:
                per_tile.append(spans[2] / -(-(te - tb) // 64))
            phases.append(tuple(round(x, 1) for x in spans))
            loaded.append(ev[1])
            prev = ev[3]
        # mainloop steps: time since the previous step's end or the item's tiles landing, whichever is later
        steps, prev = [], None
        for n in range(STEPS):
            t = ck[c, STEP_BASE + n].item()
            if t == 0:
                break
            start = max([x for x in loaded if x <= t] + ([prev] if prev is not None else []))
            steps.append(round((t - start) * us, 2))
            prev = t
        counters.append([tl[c, COUNTER_BASE + i, 0].item() if tl.shape[1] > COUNTER_BASE + i else 0
                         for i in range(len(COUNTERS))])
        # per CTA: (end µs, part, row tile, items, tiles, phases of its items, step times)
        rows.append(((gt[c, END].item() - t0) / 1e3, part, c // num_parts, len(tiles), sum(tiles), phases, steps))
    return {
        "ghz": rate, "ctas": len(live), "first": first, "later": later, "per_tile": per_tile,
        "entry": [(gt[c, 0].item() - t0) / 1e3 for c in live],
        "done": [(gt[c, DONE].item() - t0) / 1e3 for c in live],
        "sync": [(gt[c, GRID_SYNC].item() - t0) / 1e3 for c in live if gt[c, GRID_SYNC] != 0],
        "end": [(gt[c, END].item() - t0) / 1e3 for c in live],
        "ctas_detail": sorted(rows, reverse=True),
        "items_per_cta": statistics.mean(r[3] for r in rows),
        # per counter: its total over each CTA in µs ([] where the kernel keeps no counters)
        "counters": [[row[i] * us for row in counters] for i in range(len(COUNTERS))]
        if any(any(row) for row in counters) else [],
    }


def spread(xs):
    return f"{min(xs):6.1f} / {statistics.median(xs):6.1f} / {max(xs):6.1f}" if xs else "     -"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="1x4096,8x8192,32x4096", help="comma-separated BATCHxSEQLEN")
    ap.add_argument("--heads", default="128")
    ap.add_argument("--q-len", type=int, default=1)
    ap.add_argument("--variants", default="default", help="comma-separated mainloop variants or 'default'")
    ap.add_argument("--combine", default="default", help="default, fused or separate")
    ap.add_argument("--varlen", action="store_true", help="lengths drawn around SEQLEN as in the benchmark")
    ap.add_argument("--kv-format", default="bf16", choices=("bf16", "fp8_e4m3", "fp8_ds_mla"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-flush", action="store_true", help="leave L2 as the previous call left it")
    ap.add_argument("--worst", type=int, default=0, help="also list the N CTAs that end last (median call)")
    args = ap.parse_args()

    module = load_sm90()
    if not hasattr(module, "timeline_take"):
        raise SystemExit(f"{module.__name__} has no timeline: it was not built with MLA_SM90_TIMELINE=1")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} extension {module.__name__}")
    for h_q in (int(h) for h in args.heads.split(",")):
        for b, L in ((int(x), int(y)) for x, y in (c.split("x") for c in args.configs.split(","))):
            q, kv, table, lens, kv_scale = make_inputs(b, args.q_len, h_q, L, varlen=args.varlen,
                                                       kv_format=args.kv_format)
            for v in args.variants.split(","):
                plan = plan_decode(q, kv, table, lens, kv_format=args.kv_format, kv_scale=kv_scale,
                                   backend="cuda_sm90")
                if v != "default":
                    plan.state.variant = int(v)
                if args.combine != "default":
                    plan.state.fuse_combine = args.combine == "fused"
                s = plan.state.schedule
                items = s.items.tolist()
                offsets = s.part_offsets.tolist()
                for _ in range(3):
                    plan.run(q, kv, kv_scale=kv_scale)
                torch.cuda.synchronize()
                module.timeline_take()
                runs = []
                for _ in range(args.reps):
                    if not args.no_flush:
                        flush.zero_()
                    torch.cuda.synchronize()
                    plan.run(q, kv, kv_scale=kv_scale)
                    torch.cuda.synchronize()
                    runs.append(analyse(module.timeline_take(), items, offsets, s.num_parts))

                def med(f):
                    return statistics.median(f(r) for r in runs)

                fused = "fused" if plan.state.fuse_combine else "separate"
                print(f"\nh={h_q} b={b} L={L} s_q={args.q_len} v{plan.state.variant} {fused}: {runs[0]['ctas']} CTAs, "
                      f"{s.num_parts} parts, {med(lambda r: r['items_per_cta']):.2f} items/CTA, "
                      f"SM clock {med(lambda r: r['ghz']):.2f} GHz, {args.reps} calls (medians)")
                last = runs[len(runs) // 2]
                print(f"  entry      min / med / max {spread(last['entry'])} µs")
                for which in ("first", "later"):
                    if not last[which]["meta"]:
                        continue
                    cells = "  ".join(f"{ph} {med(lambda r: statistics.mean(r[which][ph]) if r[which][ph] else 0):5.2f}"
                                      f" ({med(lambda r: p90(r[which][ph])):5.2f})" for ph in PHASES)
                    print(f"  {which:5s} item mean (p90) µs: {cells}")
                print(f"  per tile   {med(lambda r: statistics.mean(r['per_tile'])):.3f} µs (mean over items)")
                print(f"  items done min / med / max {spread(last['done'])} µs")
                if last["sync"]:
                    print(f"  grid sync  min / med / max {spread(last['sync'])} µs")
                print(f"  end        min / med / max {spread(last['end'])} µs  (median call: "
                      f"{med(lambda r: max(r['end'])):.1f} µs)")
                if last["counters"]:
                    print("  waits and phases, total per CTA, median over CTAs (p90) µs:")
                    for i, name in enumerate(COUNTERS):
                        print(f"    {name:34s} {med(lambda r: statistics.median(r['counters'][i])):7.2f} "
                              f"({med(lambda r: p90(r['counters'][i])):7.2f})")
                by_step = [[r[6][n] for r in last["ctas_detail"] if len(r[6]) > n] for n in range(12)]
                print("  mainloop step n (v2: tile, v5: pair), median over CTAs µs: "
                      + " ".join(f"{statistics.median(x):.2f}" for x in by_step if x))
                if args.worst:
                    detail = last["ctas_detail"]
                    print("  CTAs by end (end µs, part, row tile, items, tiles, per item (meta, load, loop, store) µs):")
                    for row in detail[:args.worst] + [None] + detail[len(detail) // 2:len(detail) // 2 + 3]:
                        print("    ..." if row is None else f"    {row[0]:6.1f} part {row[1]:3d} tile {row[2]} "
                              f"items {row[3]} tiles {row[4]:3d} {row[5]}\n        steps {row[6]}")
            del q, kv, table
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
