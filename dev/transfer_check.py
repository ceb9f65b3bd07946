"""How good is the transfer rule (mla_dispatch/dispatch/transfer.py) on a device we measured? No GPU needed.

Given saved `bench` runs of one device (``bench-<grid>.json``, every backend timed on each config), this asks what
``auto`` would have chosen there with only a table carried from another device (the nearest shipped table of the
same architecture, never the device's own), and reads that backend's time from the same run: per config, the
carried choice against the fastest correct backend. The first backend of the carried ranking that ran the config
correctly in that run counts as what feasibility would have let through; a config whose shape class the table does
not know falls to the default order the same way.

    python dev/transfer_check.py bench_out/bench-flashmla.json bench_out/bench-heads.json ...
    python dev/transfer_check.py --p-sweep        # the cost model's fit error per overlap exponent p, on the
                                                  # shipped tables (transfer.py's docstring quotes it)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from mla_dispatch.dispatch import transfer, tuned
from mla_dispatch.dispatch.platform import Platform, platform_key
from mla_dispatch.dispatch.registry import default_order
from mla_dispatch.tools.autocheck import _us
from mla_dispatch.tools.bench import BenchConfig
from mla_dispatch.tools.tune import config_problem

_PLATFORM = re.compile(r"^(?P<kind>\w+): (?P<name>.+) \((?P<arch>\S+)(?: capability (?P<maj>\d+)\.(?P<min>\d+))?, "
                       r"(?P<units>\d+) compute units\)$")


def platform_of(env: dict) -> Platform:
    """The platform a bench run was made on, from its header (``Platform.describe()``)."""
    m = _PLATFORM.match(env["platform"])
    if m is None:
        raise SystemExit(f"cannot read the platform of the run: {env['platform']!r}")
    cap = (int(m["maj"]), int(m["min"])) if m["maj"] else None
    return Platform(m["kind"], m["name"], cap, m["arch"], int(m["units"]))


def check(paths: list[Path], tolerance: float) -> int:
    rows, problems, platform = [], {}, None
    for path in paths:
        doc = json.loads(path.read_text())
        platform = platform or platform_of(doc["environment"])
        seed = int(doc.get("seed", 0))
        for i, (label, cfg) in enumerate(doc["configs"].items()):
            problems[label] = config_problem(BenchConfig(**cfg), seed=seed + i, device_type="cuda")
        rows += doc["rows"]
    decision = tuned.transferred_decision(platform)
    if decision is None:
        print(f"no table to carry to {tuned.fingerprint(platform)}")
        return 1
    print(f"device: {platform.describe()}\nrule: {decision.describe()}\n")
    print("| config | carried ranking | would run | µs | fastest correct backend, µs | ratio | verdict |")
    print("|---|---|---|---:|---|---:|---|")
    metric = "graph" if any(r.get("us_graph") for r in rows) else "run"
    table, order = decision.table(), default_order(platform_key(platform))
    worst, failed, checked = None, [], 0
    for label, problem in problems.items():
        ok = {r["backend"]: _us(r, metric) for r in rows if r["config"] == label and r["status"] == "ok"
              and r["backend"] not in ("auto", "FlashMLA (direct)") and ":" not in r["backend"] and _us(r, metric)}
        if not ok:
            continue
        ranked = tuned.lookup_ranking(table, problem)
        pick = next(b for b in (*ranked, *order) if b in ok or b == "reference")
        best = min(ok, key=ok.get)
        ratio = ok[pick] / ok[best] if pick in ok else None
        checked += 1
        verdict = "ok" if ratio is not None and ratio <= 1 + tolerance else "over"
        if verdict != "ok":
            failed.append(label)
        if ratio is not None and (worst is None or ratio > worst[0]):
            worst = (ratio, label)
        print(f"| {label} | {', '.join(ranked) or '(class not in the table)'} | {pick} | "
              f"{ok.get(pick, float('nan')):.1f} | {best} {ok[best]:.1f} | "
              f"{'' if ratio is None else format(ratio, '.3f')} | {verdict} |")
    print(f"\ncarried rule within {tolerance:.1%} of the fastest correct backend on {checked - len(failed)} of "
          f"{checked} configs" + (f" (worst {worst[0]:.3f}x, {worst[1]})" if worst else "")
          + (f"; over: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def p_sweep() -> int:
    """Summed squared relative error of each backend's fit, per overlap exponent p, on every shipped table."""
    for path in sorted(tuned.SHIPPED_DIR.glob("*.json")):
        doc = tuned.read_table(path)
        if not transfer.can_transfer(doc):
            print(f"{path.name}: no work recorded, cannot fit")
            continue
        bw, fl = doc["ceilings"]["bytes_per_s"], doc["ceilings"]["flops_per_s"]
        line, chosen = [], transfer.P_NORM
        for p in (1, 2, 3, 4, 6, 8, 16):
            transfer.P_NORM = p
            total = 0.0
            for backend in sorted({b for t in doc["measurements"].values() for b in t}):
                points = [(doc["work"][k]["bytes"] / bw * 1e6, doc["work"][k]["flops"] / fl * 1e6,
                           doc["work"][k]["configs"], t[backend])
                          for k, t in doc["measurements"].items() if backend in t and k in doc["work"]]
                cost = transfer.fit_cost(points)
                total += sum(((cost.us(m, f, n) - us) / us) ** 2 for m, f, n, us in points)
            line.append(f"p={p}: {total:.2f}")
        transfer.P_NORM = chosen
        print(f"{path.name}: " + ", ".join(line))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_json", nargs="*", type=Path)
    parser.add_argument("--tolerance", type=float, default=0.03)
    parser.add_argument("--p-sweep", action="store_true")
    args = parser.parse_args(argv)
    if args.p_sweep:
        return p_sweep()
    if not args.bench_json:
        parser.error("give bench JSON files, or --p-sweep")
    return check(args.bench_json, args.tolerance)


if __name__ == "__main__":
    sys.exit(main())
