"""``python -m mla_dispatch tune``: measure the backends here and write this device's dispatch table.

The table maps a shape bucket (:func:`mla_dispatch.dispatch.tuned.shape_bucket`) to the fastest backend that
passed the correctness gate on every config of that bucket, on this device, with these software versions, and keeps
every such backend's time and the work of the bucket's configs (so it can be carried to other devices). Its
format, where it is read from and how selection uses it: :mod:`mla_dispatch.dispatch.tuned`.

``--quick`` is what a user of a device we never measured runs: the shape classes that matter at one or two sizes
each (:func:`tune_configs`), one timing per backend and config, and a time budget (:data:`QUICK_BUDGET_S`) after
which no further config starts; the progress bar shows the time spent against it. Importing and building the
backends (the native kernel's first build takes minutes; ``python -m mla_dispatch build`` does it ahead) happens
before the clock starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
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

__all__ = ["tune_configs", "config_problem", "config_bucket", "pick_winners", "bucket_work", "write_table", "main",
           "QUICK_BUDGET_S"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: The time budget of ``tune --quick`` (seconds of measuring; importing and building the backends come before).
QUICK_BUDGET_S = 120.0


# -- the shape grid -----------------------------------------------------------------------------------


def tune_configs(quick: bool = False, device_type: str = "cuda") -> list[BenchConfig]:
    """The configs ``tune`` measures, the ones that matter most first (a time budget cuts the tail).

    On an accelerator: the shape classes DeepSeek serving hits (h_q 128 / 64 / 32 / 16, i.e. tensor parallelism 1 /
    2 / 4 / 8, s_q 1 and 2 for one MTP token; pages of 64, 1 and 16; the two fp8 caches; V3.2's sparse decode), each
    at the batches and lengths where the winner changes (one request, a few, a serving batch; short and long
    contexts). ``quick`` keeps one or two sizes per class; the full grid adds sizes, the fp8 caches at 16 heads and
    sparse decode at 64. On a CPU, ``quick`` is a handful of tiny configs (seconds with the reference backend).
    """
    from mla_dispatch.tools.bench import BenchConfig as C

    if quick and device_type == "cpu":
        return [C(2, 1, 16, 256), C(3, 1, 16, 400, varlen=True), C(2, 2, 16, 256, causal=True),
                C(2, 1, 16, 256, page_size=16), C(2, 1, 16, 256, kv_format="fp8_ds_mla")]
    core = [
        C(128, 1, 128, 8192, varlen=True), C(128, 2, 128, 8192, varlen=True, causal=True),
        C(64, 1, 16, 8192), C(64, 1, 32, 8192), C(64, 1, 64, 8192),
        C(1, 1, 128, 4096), C(8, 1, 128, 4096), C(1, 1, 128, 32768), C(32, 1, 128, 32768),
        C(32, 1, 128, 8192, varlen=True, page_size=1), C(32, 1, 128, 8192, varlen=True, page_size=16),
        C(32, 1, 128, 8192, varlen=True, page_size=128), C(32, 1, 128, 8192, varlen=True, page_size=256),
        C(64, 1, 128, 8192, varlen=True, kv_format="fp8_e4m3"), C(64, 1, 128, 8192, varlen=True, kv_format="fp8_ds_mla"),
        C(64, 1, 128, 16384, varlen=True, kv_format="fp8_ds_mla", topk=2048),
    ]
    if quick:
        return core
    return core + [
        C(128, 1, 128, 32768, varlen=True), C(128, 2, 128, 32768, varlen=True, causal=True),
        C(4, 1, 16, 4096), C(4, 1, 32, 4096), C(4, 1, 64, 4096), C(8, 2, 128, 4096, causal=True),
        C(64, 1, 16, 8192, kv_format="fp8_e4m3"), C(64, 1, 16, 8192, kv_format="fp8_ds_mla"),
        C(64, 1, 64, 16384, varlen=True, kv_format="fp8_ds_mla", topk=2048),
    ]


def config_problem(cfg: BenchConfig, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                   device_type: str = "any") -> DecodeProblem:
    """The problem of the case :func:`~mla_dispatch.tools.bench.run_bench` makes for ``cfg`` with ``seed`` (its
    lengths are drawn on the CPU; no cache is built)."""
    from mla_dispatch.tools.bench import case_lengths

    fmt = cfg.kv_format or ("bf16" if dtype == torch.bfloat16 else "fp16")
    longest = int(case_lengths(cfg, torch.Generator().manual_seed(seed)).max())
    return DecodeProblem(batch=cfg.batch, q_len=cfg.q_len, num_heads_q=cfg.num_heads_q,
                         num_heads_kv=cfg.num_heads_kv, head_dim_qk=cfg.head_dim_qk, head_dim_v=cfg.head_dim_v,
                         page_size=cfg.page_size, max_blocks=max(1, -(-longest // cfg.page_size)), q_dtype=dtype,
                         kv_format=fmt, causal=cfg.causal and cfg.q_len > 1, topk=cfg.topk, return_lse=True,
                         device_type=device_type)


def config_bucket(cfg: BenchConfig, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> str:
    """The shape bucket of the case :func:`~mla_dispatch.tools.bench.run_bench` makes for ``cfg`` with ``seed``."""
    return shape_bucket(config_problem(cfg, dtype, seed))


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


def bucket_work(rows: Sequence[BenchRow], buckets: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per bucket, the FLOPs and bytes of its configs that have rows, summed, and how many there are (what
    :mod:`mla_dispatch.dispatch.transfer` needs to carry the table to another device)."""
    per_config = {r.config: (r.flops, r.bytes) for r in rows if r.flops or r.bytes}
    work: dict[str, dict[str, float]] = {}
    for label, (flops, nbytes) in per_config.items():
        entry = work.setdefault(buckets[label], {"flops": 0.0, "bytes": 0.0, "configs": 0})
        entry["flops"] += flops
        entry["bytes"] += nbytes
        entry["configs"] += 1
    return work


# -- the table on disk --------------------------------------------------------------------------------


def write_table(path: Path, doc: dict) -> None:
    """Write a table document (format: :mod:`mla_dispatch.dispatch.tuned`) atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    tmp.replace(path)


def _table_doc(env: dict, device: str, command: str, metric: str, ceilings: dict | None, table: dict,
               measurements: dict, work: dict) -> dict:
    """A table document (format: :mod:`mla_dispatch.dispatch.tuned`) for the run described by ``env``
    (:func:`mla_dispatch.tools.bench.environment`: its device fingerprint, platform, date and versions)."""
    return {"format": TABLE_FORMAT, "fingerprint": env["fingerprint"], "device": device, "platform": env["platform"],
            "versions": {k: env.get(k) for k in ("mla_dispatch", "torch", "cuda", "triton")} | {"backends": env["backends"]},
            "created": env["date"], "command": command, "metric": metric, "ceilings": ceilings, "table": table,
            "measurements": measurements, "work": {b: w for b, w in work.items() if b in measurements}}


def _read_json(path: Path, option: str) -> dict:
    """The JSON object in file ``path``; UsageError naming ``option`` if it is missing, a folder, unreadable, not
    UTF-8 text, not JSON or not an object."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"argument {option}: {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise UsageError(f"argument {option}: {str(path)!r} is a folder, not a file") from None
    except UnicodeDecodeError:
        raise UsageError(f"argument {option}: {str(path)!r} is not text (expected a JSON file)") from None
    except OSError as exc:
        raise UsageError(f"argument {option}: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"argument {option}: {str(path)!r} is not JSON ({exc.msg} at line {exc.lineno}, column "
                         f"{exc.colno})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"argument {option}: {str(path)!r} holds a JSON {type(doc).__name__}, expected an object")
    return doc


def _table_from_bench(path: Path, args, argv) -> int:
    """``--from-json``: the winners of a saved bench run, written as a table for the device it ran on."""
    from mla_dispatch.tools.bench import BenchConfig, BenchRow

    doc = _read_json(path, "--from-json")
    try:  # a saved run's fields; anything else is not one (a user mistake: one line, not a traceback)
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
        command = (doc.get("command", "") + f" | python -m mla_dispatch tune --from-json {path.name} "
                   f"--metric {args.metric}")
        out = _table_doc(env, env["device"], command, args.metric, doc.get("ceilings"), table, measurements,
                         bucket_work(rows, buckets))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        what = f"no {exc}" if isinstance(exc, KeyError) else str(exc).splitlines()[0][:200]
        raise UsageError(f"argument --from-json: {str(path)!r} is not a saved bench run ({what}); expected the JSON "
                         "`python -m mla_dispatch bench --json FILE` writes (configs, rows, environment)") from None
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
    p.add_argument("--quick", action="store_true",
                   help=f"the shape classes that matter at one or two sizes each, one short timing each, at most "
                        f"{QUICK_BUDGET_S:.0f} s of measuring (on a CPU: a few tiny configs)")
    p.add_argument("--budget-s", type=positive_float, default=None,
                   help=f"stop starting configs after this many seconds of measuring (default: {QUICK_BUDGET_S:.0f} "
                        f"with --quick, none otherwise); the table holds the configs measured")
    p.add_argument("--backends", default=None, help="comma-separated names (default: every available backend)")
    p.add_argument("--metric", choices=("run", "graph"), default="graph",
                   help="CUDA-graph replay (default; eager DecodePlan.run for a backend without graphs, and on a CPU) "
                        "or the eager DecodePlan.run")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help=f"table path (default: ${ENV_VAR} or the per-device cache file)")
    p.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    p.add_argument("--rep-ms", type=positive_float, default=None,
                   help="timing budget per measurement (default: 25 with --quick, else 100)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
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
    from mla_dispatch.tools.bench import default_backends, environment, grid_configs, grid_names, nothing_can_run, \
        run_bench

    device = parse_device(args.device)
    configs = ([c for g in grid_names(args.grid) for c in grid_configs(g)] if args.grid is not None
               else tune_configs(args.quick, device.type))
    platform = detect_platform(device)
    dtype = _DTYPES[args.dtype]
    budget = args.budget_s if args.budget_s is not None else (QUICK_BUDGET_S if args.quick else None)
    rep_ms = args.rep_ms if args.rep_ms is not None else (25.0 if args.quick else 100.0)
    chosen = backend_names(args.backends)
    backends = [n for n in chosen or default_backends(device) if n != "auto"]  # auto is what the table decides
    if device.type != "cpu" and not chosen and not args.quick:
        backends.append("reference")  # a candidate too, so every bucket gets an entry
    path = Path(args.out) if args.out else table_path(platform)
    if not args.dry_run:
        writable_file(str(path), "--out")
    why = nothing_can_run(backends) if backends else "no registered backend is available here"
    if why:
        print(f"nothing to run: {why}; no table written", file=sys.stderr)
        return 1
    t0 = time.monotonic()
    env = environment(device, backends)  # imports every backend (and builds the JIT-built ones) before the clock
    ready_s = time.monotonic() - t0
    t0 = time.monotonic()
    rows, ceilings = run_bench(configs, backends, device=device, dtype=dtype, graphs=args.metric == "graph",
                               rep_ms=rep_ms, progress=not args.quiet, timings=frozenset({args.metric}), peer=False,
                               budget_s=budget, desc="tune")
    spent = time.monotonic() - t0
    measured = list(dict.fromkeys(r.config for r in rows))
    buckets = {c.label: config_bucket(c, dtype, seed=i) for i, c in enumerate(configs) if c.label in measured}
    rows = [r for r in rows if r.backend in backends]  # peers timed beside them (FlashMLA, FA3 direct): not backends
    table, measurements = pick_winners(rows, buckets, args.metric)
    given = argv if argv is not None else sys.argv[1:]
    command = "python -m mla_dispatch tune " + " ".join(shlex.quote(a) for a in given)
    doc = _table_doc(env, platform.name, command.strip(), args.metric, dataclasses.asdict(ceilings), table,
                     measurements, bucket_work(rows, buckets))
    print(f"## tune on {platform.describe()} ({env['date']}, metric: {args.metric})\n")
    print("| bucket | fastest correct backend | µs summed over the bucket's configs |\n|---|---|---|")
    for bucket in sorted(set(buckets.values())):
        if bucket in table:
            others = ", ".join(f"{b} {us:.1f}" for b, us in sorted(measurements[bucket].items(), key=lambda kv: kv[1]))
            print(f"| {bucket} | {table[bucket]} | {others} |")
        else:
            print(f"| {bucket} | (none ran every config correctly) | |")
    limit = f" of a {budget:g} s budget" if budget is not None else ""
    print(f"\nmeasured {len(measured)} of {len(configs)} configs in {spent:.0f} s{limit} (backends imported and "
          f"built in {ready_s:.0f} s before)")
    if len(measured) < len(configs):
        print("not measured (budget spent): " + ", ".join(c.label for c in configs if c.label not in measured))
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
