"""``python -m mla_dispatch tune``: measure the backends here and write this device's dispatch table.

The table maps a shape bucket (:func:`mla_dispatch.dispatch.tuned.shape_bucket`) to the fastest backend that
passed the correctness gate on every config of that bucket, on this device, with these software versions. Its
format, where it is read from and how selection uses it: :mod:`mla_dispatch.dispatch.tuned`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from mla_dispatch.dispatch.platform import detect_platform
from mla_dispatch.dispatch.problem import DecodeProblem
from mla_dispatch.dispatch.tuned import ENV_VAR, TABLE_FORMAT, shape_bucket, table_path
from mla_dispatch.tools.args import (CommandParser, UsageError, backend_names, parse_device, positive_float,
                                     usage_error, writable_file)

if TYPE_CHECKING:  # the harness is imported only by `tune` itself, not when a table is loaded
    from mla_dispatch.tools.bench import BenchConfig, BenchRow

__all__ = ["tune_configs", "config_bucket", "pick_winners", "write_table", "main"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}



# -- the shape grid -----------------------------------------------------------------------------------


def tune_configs(quick: bool = False) -> list[BenchConfig]:
    """Configs covering the buckets users hit; each bucket gets a small and a large batch where affordable."""
    from mla_dispatch.tools.bench import BenchConfig

    if quick:
        return [BenchConfig(2, 1, 16, 256), BenchConfig(3, 1, 16, 400, varlen=True),
                BenchConfig(2, 2, 16, 256, causal=True), BenchConfig(2, 1, 16, 256, page_size=16),
                BenchConfig(2, 1, 16, 256, kv_format="fp8_ds_mla")]
    dense = [BenchConfig(b, s_q, h, L, varlen=True)
             for h, s_q in ((16, 1), (32, 1), (64, 1), (128, 1), (128, 2)) for b, L in ((4, 4096), (64, 8192))]
    pages = [BenchConfig(32, 1, 128, 8192, varlen=True, page_size=ps) for ps in (1, 16, 128, 256)]
    fp8 = [BenchConfig(64, 1, 128, 8192, varlen=True, kv_format=f) for f in ("fp8_e4m3", "fp8_ds_mla")]
    sparse = [BenchConfig(64, 1, 128, 16384, varlen=True, kv_format="fp8_ds_mla", topk=2048)]
    return dense + pages + fp8 + sparse


def config_bucket(cfg: BenchConfig, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> str:
    """The shape bucket of the case :func:`~mla_dispatch.tools.bench.run_bench` makes for ``cfg`` with ``seed``
    (its lengths are drawn on the CPU; no cache is built)."""
    from mla_dispatch.tools.bench import case_lengths

    fmt = cfg.kv_format or ("bf16" if dtype == torch.bfloat16 else "fp16")
    longest = int(case_lengths(cfg, torch.Generator().manual_seed(seed)).max())
    problem = DecodeProblem(batch=cfg.batch, q_len=cfg.q_len, num_heads_q=cfg.num_heads_q,
                            num_heads_kv=cfg.num_heads_kv, head_dim_qk=cfg.head_dim_qk, head_dim_v=cfg.head_dim_v,
                            page_size=cfg.page_size, max_blocks=max(1, -(-longest // cfg.page_size)), q_dtype=dtype,
                            kv_format=fmt, causal=cfg.causal and cfg.q_len > 1, topk=cfg.topk, return_lse=True,
                            device_type="any")
    return shape_bucket(problem)


def _metric_us(row: BenchRow, metric: str) -> float | None:
    if metric == "graph" and row.us_graph is not None:
        return row.us_graph
    return row.us_run


def pick_winners(rows: Sequence[BenchRow], buckets: dict[str, str], metric: str = "run"
                 ) -> tuple[dict[str, str], dict[str, dict[str, float]]]:
    """Per bucket, the backend with the least summed time among those that ran every config of it correctly.

    ``buckets`` maps a config label to its bucket. Returns (table, measurements).
    """
    configs_of: dict[str, set[str]] = {}
    for label, bucket in buckets.items():
        configs_of.setdefault(bucket, set()).add(label)
    times: dict[str, dict[str, dict[str, float]]] = {}  # bucket -> backend -> config -> us
    bad: set[tuple[str, str]] = set()
    for r in rows:
        bucket = buckets[r.config]
        us = _metric_us(r, metric)
        if r.status != "ok" or us is None:
            bad.add((bucket, r.backend))
            continue
        times.setdefault(bucket, {}).setdefault(r.backend, {})[r.config] = us
    table, measurements = {}, {}
    for bucket, per_backend in times.items():
        complete = {b: sum(t.values()) for b, t in per_backend.items()
                    if (bucket, b) not in bad and set(t) == configs_of[bucket]}
        if complete:
            measurements[bucket] = complete
            table[bucket] = min(complete, key=complete.get)
    return table, measurements


# -- the table on disk --------------------------------------------------------------------------------


def write_table(path: Path, doc: dict) -> None:
    """Write a table document (format: :mod:`mla_dispatch.dispatch.tuned`) atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    tmp.replace(path)


def _table_doc(env: dict, device: str, command: str, metric: str, ceilings: dict | None, table: dict,
               measurements: dict) -> dict:
    """A table document (format: :mod:`mla_dispatch.dispatch.tuned`) for the run described by ``env``
    (:func:`mla_dispatch.tools.bench.environment`: its device fingerprint, platform, date and versions)."""
    return {"format": TABLE_FORMAT, "fingerprint": env["fingerprint"], "device": device, "platform": env["platform"],
            "versions": {k: env.get(k) for k in ("mla_dispatch", "torch", "cuda", "triton")} | {"backends": env["backends"]},
            "created": env["date"], "command": command, "metric": metric, "ceilings": ceilings, "table": table,
            "measurements": measurements}


def _table_from_bench(path: Path, args, argv) -> int:
    """``--from-json``: the winners of a saved bench run, written as a table for the device it ran on."""
    from mla_dispatch.tools.bench import BenchConfig, BenchRow

    doc = json.loads(path.read_text())
    dtype = _DTYPES[doc.get("dtype", "bf16")]
    seed = int(doc.get("seed", 0))
    configs = {label: BenchConfig(**cfg) for label, cfg in doc["configs"].items()}
    buckets = {label: config_bucket(cfg, dtype, seed=seed + i) for i, (label, cfg) in enumerate(configs.items())}
    env = doc["environment"]
    names = set(env["backends"])  # the backends the run measured (not `auto`, not the FlashMLA or FA3 peer)
    if args.backends:
        names &= {n.strip() for n in args.backends.split(",")}
    fields = set(BenchRow.__dataclass_fields__)
    rows = [BenchRow(**{k: v for k, v in r.items() if k in fields}) for r in doc["rows"] if r["backend"] in names]
    table, measurements = pick_winners(rows, buckets, args.metric)
    command = doc.get("command", "") + f" | python -m mla_dispatch tune --from-json {path.name} --metric {args.metric}"
    out = _table_doc(env, env["device"], command, args.metric, doc.get("ceilings"), table, measurements)
    for bucket in sorted(set(buckets.values())):
        print(f"{bucket}: {table.get(bucket, '(none ran every config correctly)')}")
    if args.dry_run:
        return 0
    target = Path(args.out) if args.out else table_path(detect_platform())
    write_table(target, out)
    print(f"wrote {target}")
    return 0


# -- CLI ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(prog="python -m mla_dispatch tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", default=None,
                   help="bench grid name(s), comma-separated, instead of the built-in tuning grid")
    p.add_argument("--quick", action="store_true", help="a tiny grid (seconds on a CPU)")
    p.add_argument("--backends", default=None, help="comma-separated names (default: every available backend)")
    p.add_argument("--metric", choices=("run", "graph"), default="run",
                   help="eager DecodePlan.run time (default) or CUDA-graph replay where the backend supports it")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help=f"table path (default: ${ENV_VAR} or the per-device cache file)")
    p.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    p.add_argument("--rep-ms", type=positive_float, default=100.0)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--from-json", default=None, metavar="BENCH_JSON",
                   help="make the table from a saved `bench` run (its rows, device and versions) instead of measuring")
    args = p.parse_args(argv)
    try:
        if args.from_json:
            return _table_from_bench(Path(args.from_json), args, argv)
        return _run(args, argv)
    except UsageError as exc:
        return usage_error(p.prog, exc)


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    from mla_dispatch.tools.bench import (default_backends, environment, grid_configs, grid_names, nothing_can_run,
                                          run_bench)

    configs = ([c for g in grid_names(args.grid) for c in grid_configs(g)] if args.grid is not None
               else tune_configs(args.quick))
    device = parse_device(args.device)
    platform = detect_platform(device)
    dtype = _DTYPES[args.dtype]
    chosen = backend_names(args.backends)
    backends = [n for n in chosen or default_backends(device) if n != "auto"]  # auto is what the table decides
    if device.type != "cpu" and not chosen:
        backends.append("reference")  # a candidate too, so every bucket gets an entry
    path = Path(args.out) if args.out else table_path(platform)
    if not args.dry_run:
        writable_file(str(path), "--out")
    why = nothing_can_run(backends) if backends else "no registered backend is available here"
    if why:
        print(f"nothing to run: {why}; no table written", file=sys.stderr)
        return 1
    rows, ceilings = run_bench(configs, backends, device=device, dtype=dtype, graphs=args.metric == "graph",
                               rep_ms=args.rep_ms, progress=not args.quiet)
    buckets = {c.label: config_bucket(c, dtype, seed=i) for i, c in enumerate(configs)}
    rows = [r for r in rows if r.backend in backends]  # peers timed beside them (FlashMLA, FA3 direct): not backends
    table, measurements = pick_winners(rows, buckets, args.metric)
    env = environment(device, backends)
    given = argv if argv is not None else sys.argv[1:]
    command = "python -m mla_dispatch tune " + " ".join(shlex.quote(a) for a in given)
    doc = _table_doc(env, platform.name, command.strip(), args.metric, dataclasses.asdict(ceilings), table,
                     measurements)
    print(f"## tune on {platform.describe()} ({env['date']}, metric: {args.metric})\n")
    print("| bucket | fastest correct backend | µs summed over the bucket's configs |\n|---|---|---|")
    for bucket in sorted(set(buckets.values())):
        if bucket in table:
            others = ", ".join(f"{b} {us:.1f}" for b, us in sorted(measurements[bucket].items(), key=lambda kv: kv[1]))
            print(f"| {bucket} | {table[bucket]} | {others} |")
        else:
            print(f"| {bucket} | (none ran every config correctly) | |")
    bad = [r for r in rows if r.status in ("wrong", "error")]
    for r in bad:
        print(f"excluded: {r.backend} on {r.config}: {r.status}: {r.note}", file=sys.stderr)
    if not table:
        print(f"nothing ran: no backend ({', '.join(backends)}) ran every config of any bucket correctly; "
              f"no table written", file=sys.stderr)
        return 1
    if args.dry_run:
        return 0
    write_table(path, doc)
    print(f"\nwrote {path}")
    if args.out and Path(args.out) != table_path(platform):
        print(f"(selection reads {table_path(platform)}; set {ENV_VAR}={path} to use this one)")
    return 0
