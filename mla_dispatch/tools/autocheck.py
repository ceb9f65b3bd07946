"""Is ``auto`` right? Per config of a ``bench`` run, the time of what ``backend="auto"`` chose against the fastest
backend that passed the correctness gate on the same inputs in the same run (``bench --check-auto TOL``).

A bench run times ``auto`` as a backend of its own (its plan, its own CUDA-graph capture) beside every backend it
could have chosen, on the same inputs, after the same correctness gate. Here each config's ``auto`` time is set
against the least time among the correct rows of the registered backends (not FlashMLA's own call, which ``auto``
cannot choose, nor a backend forced into a variant, ``name:key=value``). Times are CUDA-graph replays where the run
took them (a row without one counts its eager ``DecodePlan.run``), else eager ``DecodePlan.run``. The row of the
backend ``auto`` chose is shown too: when ``auto`` is over while that row is not, the choice was right and the two
captures of the same kernels timed apart.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Iterable, Mapping, Sequence

__all__ = ["AutoCheck", "check_auto", "fastest_candidate", "format_check", "load_rows", "rows_metric"]

#: The names of the peers' own rows in bench output (:data:`mla_dispatch.tools.peers.PEER_FLASHMLA`, ``PEER_FA3``):
#: vendor libraries called directly, not backends ``auto`` can pick.
_PEERS = ("FlashMLA (direct)", "FA3 (direct)")
_CHOSE = re.compile(r"chose (\S+)")


@dataclasses.dataclass(frozen=True)
class AutoCheck:
    """One config: what ``auto`` chose and its µs, the fastest correct backend and its µs, the chosen backend's own
    row's µs, and the verdict: ``ok``, ``over`` (auto slower than the fastest by more than the tolerance),
    ``auto failed`` (auto's row was wrong, raised or declined while a backend ran), ``no auto row``, ``nothing to
    compare`` (auto ran but no other backend did) or ``nothing ran`` (neither auto nor any backend could run the
    config: not a failure)."""

    config: str
    verdict: str
    chose: str | None = None
    auto_us: float | None = None
    fastest: str | None = None
    fastest_us: float | None = None
    chosen_us: float | None = None
    note: str = ""
    paired_rounds: int | None = None  # auto_us and fastest_us are medians of this many alternating rounds
    fastest_row_us: float | None = None  # the fastest backend's own row (fastest_us unless paired)


    @property
    def ratio(self) -> float | None:
        """auto's time over the fastest correct backend's."""
        return self.auto_us / self.fastest_us if self.auto_us and self.fastest_us else None

    @property
    def failed(self) -> bool:
        return self.verdict not in ("ok", "nothing ran")


def _get(row, key):
    return row.get(key) if isinstance(row, Mapping) else getattr(row, key, None)


def _us(row, metric: str) -> float | None:
    if metric == "graph" and _get(row, "us_graph"):
        return float(_get(row, "us_graph"))
    run = _get(row, "us_run")
    return float(run) if run else None


def rows_metric(rows: Iterable) -> str:
    """The times the check compares ``rows`` by: ``graph`` (CUDA-graph replays) where any row has one, else ``run``."""
    return "graph" if any(_get(r, "us_graph") for r in rows) else "run"


def fastest_candidate(rows: Iterable, metric: str):
    """The fastest correct row of one config's ``rows`` among the backends ``auto`` could have chosen (not ``auto``
    itself, a peer's own call or a forced variant ``name:key=value``), by ``metric``; None if there is none."""
    candidates = [r for r in rows if _get(r, "backend") not in ("auto", *_PEERS) and ":" not in _get(r, "backend")
                  and _get(r, "status") == "ok" and _us(r, metric)]
    return min(candidates, key=lambda r: _us(r, metric)) if candidates else None


def check_auto(rows: Iterable, tolerance: float, metric: str | None = None) -> tuple[list[AutoCheck], str]:
    """Check every config of ``rows`` (bench rows: :class:`~mla_dispatch.tools.bench.BenchRow` or their JSON dicts);
    returns the per-config results, in the run's order, and the metric used (``graph`` where any row has a graph
    time, unless ``metric`` says otherwise). Where auto's row carries times of auto and that config's fastest backend
    taken in alternation by the same metric (``paired_*``: :func:`mla_dispatch.tools.bench.pair_auto`), those two
    medians decide the verdict; otherwise the rows' own times."""
    rows = list(rows)
    if metric is None:
        metric = rows_metric(rows)
    by_config: dict[str, list] = {}
    for r in rows:
        by_config.setdefault(_get(r, "config"), []).append(r)
    results = []
    for config, group in by_config.items():
        autos = [r for r in group if _get(r, "backend") == "auto"]
        best = fastest_candidate(group, metric)
        fastest = (dict(fastest=_get(best, "backend"), fastest_us=_us(best, metric), fastest_row_us=_us(best, metric))
                   if best is not None else {})
        if not autos:
            results.append(AutoCheck(config, "no auto row" if best is not None else "nothing ran", **fastest))
            continue
        auto = autos[0]
        match = _CHOSE.search(_get(auto, "note") or "")
        chose = _get(auto, "chosen") or (match.group(1) if match else None)
        chosen_row = next((r for r in group if _get(r, "backend") == chose and _get(r, "status") == "ok"), None)
        common = dict(chose=chose, chosen_us=_us(chosen_row, metric) if chosen_row is not None else None, **fastest)
        if best is None:
            ran = _get(auto, "status") == "ok"
            results.append(AutoCheck(config, "nothing to compare" if ran else "nothing ran", **common))
        elif _get(auto, "status") != "ok" or not _us(auto, metric):
            results.append(AutoCheck(config, "auto failed", note=f"{_get(auto, 'status')}: {_get(auto, 'note')}",
                                     **common))
        else:
            us, paired = _us(auto, metric), None
            # runs saved before paired_metric was recorded paired graph replays where auto had one
            paired_metric = _get(auto, "paired_metric") or ("graph" if _get(auto, "us_graph") else "run")
            if (_get(auto, "paired_with") == fastest["fastest"] and paired_metric == metric
                    and _get(auto, "paired_us") and _get(auto, "paired_with_us")):
                us, fastest_us, paired = (float(_get(auto, "paired_us")), float(_get(auto, "paired_with_us")),
                                          _get(auto, "paired_rounds"))
                common["fastest_us"] = fastest_us
            verdict = "ok" if us <= common["fastest_us"] * (1 + tolerance) else "over"
            results.append(AutoCheck(config, verdict, auto_us=us, paired_rounds=paired, **common))
    return results, metric


def format_check(results: Sequence[AutoCheck], tolerance: float, metric: str) -> str:
    """Markdown table of the results and a one-line verdict."""
    what = "CUDA-graph replay" if metric == "graph" else "eager DecodePlan.run"
    paired = [r.paired_rounds for r in results if r.paired_rounds]
    how = (f"; auto and the fastest timed in alternation, median of {max(paired)} rounds, where marked *" if paired
           else "")
    lines = [f"### auto against the fastest correct backend ({what} µs; tolerance {tolerance:.1%}{how})", "",
             "| config | auto chose | auto µs | fastest correct backend, µs | auto / fastest | chosen backend's own "
             "row / fastest | verdict |", "|---|---|---:|---|---:|---:|---|"]

    def f(x, fmt):
        return "" if x is None else format(x, fmt)

    for r in results:
        own = r.chosen_us / r.fastest_row_us if r.chosen_us and r.fastest_row_us else None
        best = f"{r.fastest} {r.fastest_us:.1f}" if r.fastest else ""
        verdict = r.verdict + (f" ({r.note})" if r.note else "")
        mark = "*" if r.paired_rounds else ""
        lines.append(f"| {r.config} | {r.chose or ''} | {f(r.auto_us, '.1f')}{mark} | {best}{mark} | "
                     f"{f(r.ratio, '.3f')} | {f(own, '.3f')} | {verdict.replace('|', '/')} |")
    checked = [r for r in results if r.verdict != "nothing ran"]
    failed = [r for r in checked if r.failed]
    ratios = [r for r in checked if r.ratio is not None]
    worst = max(ratios, key=lambda r: r.ratio) if ratios else None
    summary = (f"auto within {tolerance:.1%} of the fastest correct backend on {len(checked) - len(failed)} of "
               f"{len(checked)} configs" + (f" (worst {worst.ratio:.3f}x, {worst.config})" if worst else ""))
    if failed:
        summary += "; FAILED: " + ", ".join(f"{r.config} ({r.verdict})" for r in failed)
    return "\n".join(lines + ["", summary])


def load_rows(path: Path) -> list[dict]:
    """The rows of a saved bench JSON (``bench`` writes ``bench-<grids>.json``).

    Raises
    ------
    ValueError
        Not JSON, or no ``rows`` list in it.
    """
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: no 'rows' list (expected the JSON `python -m mla_dispatch bench` writes)")
    return rows
