"""Measured dispatch tables: which backend was fastest, per shape bucket, on one device.

A table is a JSON document written by ``python -m mla_dispatch tune`` (:mod:`mla_dispatch.tools.tune`)::

    {"format": "mla_dispatch-tuned-table/1",
     "fingerprint": "NVIDIA H100 80GB HBM3|sm_90", "device": ..., "versions": {...},
     "created": "...", "command": "...", "metric": "run",
     "ceilings": {"bytes_per_s": ..., "flops_per_s": ..., ...},
     "table": {"rows128-hkv1-d576x512-ps64-bf16-dense-b128-L32768": "flashmla", ...},
     "measurements": {bucket: {backend: µs summed over the bucket's configs}},
     "work": {bucket: {"flops": ..., "bytes": ..., "configs": n}}}

``measurements`` hold every backend that ran all of a bucket's configs correctly; ``work`` the FLOPs and bytes of
those configs (docs/design.md §6) and ``ceilings`` the peaks measured in the same run.

Selection (:mod:`mla_dispatch.dispatch.select`) asks :func:`active_ranking` for a platform's table; the first time,
this module decides (:func:`active_decision`), in order: the user's table (``$MLA_DISPATCH_TUNED_TABLE`` if set,
else ``$XDG_CACHE_HOME/mla_dispatch/tuned-<device>.json``, ``~/.cache`` by default); the table shipped in the
package for that device (``dispatch/tables/``); the shipped table of the nearest device of the same architecture,
carried to this one by :mod:`mla_dispatch.dispatch.transfer` (its measurements corrected for the two devices'
bandwidth and compute; the cost model is fitted then, once per process); else the default order. It never reads a
file at import. A user's table measured on another
device (fingerprint mismatch) is ignored. A table only orders candidates (per bucket, the backends it measured,
fastest first, before the others): feasibility still decides, so a backend not installed, or unable to run a
problem, is skipped for the next.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
from pathlib import Path
from typing import Mapping, Sequence

from mla_dispatch.dispatch.devices import device_peaks
from mla_dispatch.dispatch.platform import Platform
from mla_dispatch.dispatch.problem import DecodeProblem
from mla_dispatch.dispatch.transfer import assumed_peaks, can_transfer, peak_distance, transfer_table
from mla_dispatch.version import __version__

__all__ = ["TABLE_FORMAT", "ENV_VAR", "SHIPPED_DIR", "Decision", "fingerprint", "shape_class", "shape_bucket",
           "nearest_bucket", "lookup", "lookup_ranking", "default_table_path", "table_path", "shipped_table_path",
           "read_table", "active_decision", "active_ranking", "active_table", "transferred_decision", "explain_order",
           "set_tuned_table",
           "tuned_table", "reload_table", "active_table_description", "state_token"]

logger = logging.getLogger("mla_dispatch")

TABLE_FORMAT = "mla_dispatch-tuned-table/1"
ENV_VAR = "MLA_DISPATCH_TUNED_TABLE"
#: Tables measured on our own devices, shipped with the package (one file per device fingerprint).
SHIPPED_DIR = Path(__file__).resolve().parent / "tables"


def fingerprint(platform: Platform) -> str:
    """Identity of a device for measured tables: its name and architecture."""
    return f"{platform.name}|{platform.arch}"


def _pow2(n: int) -> int:
    return 1 << max(0, (max(1, n) - 1).bit_length())


def shape_class(problem: DecodeProblem) -> str:
    """The part of a bucket that must match exactly: rows per KV head, h_kv, head dims, page size, KV format,
    dense/sparse."""
    rows = problem.q_len * problem.num_heads_q // problem.num_heads_kv
    return (
        f"rows{_pow2(rows)}-hkv{problem.num_heads_kv}-d{problem.head_dim_qk}x{problem.head_dim_v}"
        f"-ps{problem.page_size}-{problem.kv_format}-{'sparse' if problem.sparse else 'dense'}"
    )


def shape_bucket(problem: DecodeProblem) -> str:
    """Key of a problem in measured tables: :func:`shape_class` plus the batch and the block table's capacity
    (``max_blocks * page_size``, the longest request it can hold), each rounded up to a power of two. Lengths
    themselves are not known at plan time (they live on the device)."""
    capacity = problem.topk if problem.sparse else problem.max_blocks * problem.page_size
    return f"{shape_class(problem)}-b{_pow2(min(problem.batch, 1 << 16))}-L{_pow2(capacity)}"


_SIZE = re.compile(r"^(?P<cls>.+)-b(?P<b>\d+)-L(?P<L>\d+)$")


def nearest_bucket(table: Mapping[str, object], problem: DecodeProblem) -> str | None:
    """The key of ``table`` that answers for ``problem``: its own bucket; else the nearest measured size of the same
    shape class (distance: octaves of batch plus octaves of capacity; ties go to the larger size); else a size-less
    entry of the class (tables of format 1). None when the table says nothing about the class."""
    key = shape_bucket(problem)
    if key in table:
        return key
    m = _SIZE.match(key)
    cls, b, cap = m["cls"], int(m["b"]), int(m["L"])
    best, best_d = None, None
    for k in table:
        km = _SIZE.match(k)
        if km is None or km["cls"] != cls:
            continue
        kb, kl = int(km["b"]), int(km["L"])
        d = (abs(kb.bit_length() - b.bit_length()) + abs(kl.bit_length() - cap.bit_length()), -kb, -kl)
        if best_d is None or d < best_d:
            best, best_d = k, d
    return best if best is not None else (cls if cls in table else None)


def lookup_ranking(table: Mapping[str, str | tuple[str, ...]], problem: DecodeProblem) -> tuple[str, ...]:
    """The backends measured for ``problem``'s bucket (:func:`nearest_bucket`), fastest first; a table entry that
    is one name ranks that one only. Empty when the table says nothing about the problem's shape class."""
    key = nearest_bucket(table, problem)
    if key is None:
        return ()
    value = table[key]
    return (value,) if isinstance(value, str) else tuple(value)


def lookup(table: Mapping[str, str | tuple[str, ...]], problem: DecodeProblem) -> str | None:
    """The measured winner for ``problem`` (the first of :func:`lookup_ranking`), or None."""
    ranked = lookup_ranking(table, problem)
    return ranked[0] if ranked else None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "device"


def default_table_path(platform: Platform) -> Path:
    """``$XDG_CACHE_HOME/mla_dispatch/tuned-<device>.json`` (``~/.cache`` when unset)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "mla_dispatch" / f"tuned-{_slug(fingerprint(platform))}.json"


def table_path(platform: Platform) -> Path:
    """Where the user's table for ``platform`` is read from and written to: ``$MLA_DISPATCH_TUNED_TABLE`` or the
    default."""
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else default_table_path(platform)


def shipped_table_path(platform: Platform) -> Path:
    """The table shipped in the package for ``platform``'s device (it may not exist)."""
    return SHIPPED_DIR / f"{_slug(fingerprint(platform))}.json"


def read_table(path: Path) -> dict:
    """Read and check a table document.

    Raises
    ------
    ValueError
        Not JSON, or not a table of this format (the message says what is wrong).
    """
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != TABLE_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{path}: format {got!r} (expected {TABLE_FORMAT!r})")
    table = doc.get("table")
    if not isinstance(table, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in table.items()):
        raise ValueError(f"{path}: 'table' must map shape buckets to backend names")
    if not isinstance(doc.get("fingerprint"), str):
        raise ValueError(f"{path}: 'fingerprint' (device identity) missing")
    return doc


@dataclasses.dataclass(frozen=True)
class Decision:
    """What orders the candidates of ``backend="auto"`` on one device.

    ``kind``: ``"yours"`` (the user's table, measured on this device), ``"shipped"`` (measured by us on this device,
    shipped in the package), ``"set"`` (:func:`set_tuned_table`), ``"transferred"`` (the table of the nearest
    measured device of the same architecture, corrected for this one: :mod:`mla_dispatch.dispatch.transfer`) or
    ``"default"`` (the backends' registered order). ``ranking``: (bucket, backends fastest first) pairs;
    ``measured_on``: the fingerprint of the device the table was measured on; ``detail``: where it came from and
    how it was corrected, in words; ``notes``: what was looked at and not used.
    """

    kind: str
    ranking: tuple[tuple[str, tuple[str, ...]], ...] = ()
    measured_on: str | None = None
    detail: str = ""
    notes: tuple[str, ...] = ()

    def table(self) -> dict[str, tuple[str, ...]]:
        """{bucket: backends fastest first} (built once; do not modify it)."""
        return self._table

    @functools.cached_property
    def _table(self) -> dict[str, tuple[str, ...]]:
        return dict(self.ranking)

    def describe(self) -> str:
        """One line: which table or rule orders the candidates, and why."""
        return self.detail + "".join(f"; {n}" for n in self.notes)


# What selection uses, per platform, decided at its first selection (never at import); a counter that changes with
# every load or reset (selection's cache key); and the table installed by set_tuned_table: (fingerprint, ranking),
# None for none, or _FILES while tables are looked up in files.
_FILES = object()
_DECISIONS: dict[Platform, Decision] = {}
_SET: object = _FILES
_GENERATION = 0
_LAST: Decision | None = None


def _ranking(doc: dict) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Per bucket of a table measured on this device: its winner, then the others it measured, fastest first."""
    measured = doc.get("measurements") or {}
    rows = []
    for bucket, winner in sorted(doc["table"].items()):
        times = measured.get(bucket) or {}
        rows.append((bucket, (winner,) + tuple(b for b in sorted(times, key=times.get) if b != winner)))
    return tuple(rows)


def _table_line(path: Path, doc: dict, origin: str) -> str:
    v = doc.get("versions", {})
    stale = [f"{k} {v[k]} -> {now}" for k, now in _current_versions().items() if v.get(k) not in (None, now)]
    return (f"{path} ({origin}; in use; {len(doc['table'])} buckets, {doc.get('created', '?')}, "
            f"metric {doc.get('metric', '?')}" + (f"; versions changed since: {', '.join(stale)}" if stale else "")
            + ")")


def _read_quietly(path: Path, notes: list[str]) -> dict | None:
    try:
        return read_table(path)
    except (OSError, ValueError) as exc:
        logger.warning("mla_dispatch: ignoring measured dispatch table: %s", exc)
        notes.append(f"{path} unreadable: {exc}")
        return None


def _decide(platform: Platform) -> Decision:
    """The user's table for this device, else the shipped one, else a transferred one, else the default order.
    Never raises: a missing file moves on, an unreadable one is logged and noted."""
    mine = fingerprint(platform)
    if _SET is not _FILES:
        if _SET is not None and _SET[0] == mine:
            return Decision("set", _SET[1], mine, f"set in-process by set_tuned_table() ({len(_SET[1])} buckets)")
        what = "for " + _SET[0] if _SET is not None else "to none"
        return Decision("default", detail=f"none (default order; set_tuned_table() set the measured table {what}, "
                                          f"files are not read)")
    notes: list[str] = []
    user = table_path(platform)
    if user.exists():
        doc = _read_quietly(user, notes)
        if doc is not None and doc["fingerprint"] == mine:
            return Decision("yours", _ranking(doc), mine, _table_line(user, doc, "yours"))
        if doc is not None:
            notes.append(f"{user} NOT used: measured on {doc['fingerprint']}, this is {mine}")
    shipped = shipped_table_path(platform)
    if shipped.exists():
        doc = _read_quietly(shipped, notes)
        if doc is not None:
            return Decision("shipped", _ranking(doc), mine, _table_line(shipped, doc, "shipped with mla_dispatch"),
                            tuple(notes))
    if platform.kind == "cpu":  # the reference is all there is: nothing to measure or carry over
        return Decision("default", detail="none (default order)", notes=tuple(notes))
    transferred = transferred_decision(platform, notes)
    if transferred is not None:
        return transferred
    if not user.exists():
        notes.insert(0, f"looked for {user} and {shipped.name} shipped")
    notes.append("write one with `python -m mla_dispatch tune --quick`")
    return Decision("default", detail="none (default order)", notes=tuple(notes))


def transferred_decision(platform: Platform, notes: list[str] | None = None) -> Decision | None:
    """The nearest shipped table of ``platform``'s architecture measured on another device, carried to it (whether or
    not the device has a table of its own); None where there is none to carry, with why appended to ``notes``."""
    notes = [] if notes is None else notes
    sources = []
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        doc = _read_quietly(path, notes)
        if (doc is None or doc["fingerprint"] == fingerprint(platform) or not can_transfer(doc)
                or doc["fingerprint"].rpartition("|")[2] != platform.arch):
            continue
        name = doc["fingerprint"].rpartition("|")[0]
        peaks = device_peaks(Platform("cuda", name, platform.capability, platform.arch, 0))
        if peaks is not None:
            sources.append((path, doc, peaks))
    if not sources:
        notes.append(f"no table measured on another device of this architecture ({platform.arch}) ships with "
                     f"mla_dispatch")
        return None
    target = device_peaks(platform)
    if target is None:  # a device we have no sheet for: the source with the same SM count, else the first
        path, doc, src = min(sources, key=lambda s: (s[2].sms != platform.num_compute_units, s[0].name))
        target = assumed_peaks(platform.name, platform.num_compute_units, src)
    else:
        path, doc, src = min(sources, key=lambda s: (peak_distance(s[2], target), s[0].name))
    moved = transfer_table(doc, src, target)
    detail = (f"transferred from {doc['fingerprint']} ({path.name}, shipped; {len(moved.ranking)} buckets), "
              f"corrected for memory bandwidth x{moved.bandwidth:.2f} and compute x{moved.compute:.2f} "
              f"({target.describe()} against {src.describe()}, spec sheets) by a cost model fitted to that table's "
              f"measurements; `python -m mla_dispatch tune --quick` measures this device instead")
    return Decision("transferred", tuple(sorted(moved.ranking.items())), doc["fingerprint"], detail, tuple(notes))


def active_decision(platform: Platform) -> Decision:
    """What orders ``auto``'s candidates on ``platform`` (:class:`Decision`); decided at the first call for the
    platform (module docstring), then cached until :func:`reload_table` or :func:`set_tuned_table`."""
    decision = _DECISIONS.get(platform)
    if decision is None:
        global _LAST
        decision = _DECISIONS[platform] = _LAST = _decide(platform)
    return decision


def active_ranking(platform: Platform) -> dict[str, tuple[str, ...]] | None:
    """{bucket: backends fastest first} that selection uses on ``platform`` (do not modify it); None for the default
    order."""
    decision = active_decision(platform)
    return decision.table() if decision.ranking else None


def active_table(platform: Platform) -> dict[str, str] | None:
    """The winners (bucket -> backend) selection uses on ``platform``: None where the default order decides."""
    ranking = active_ranking(platform)
    return None if ranking is None else {bucket: ranked[0] for bucket, ranked in ranking.items()}


def explain_order(problem: DecodeProblem, platform: Platform) -> str:
    """One line for ``explain``: which table or rule orders the candidates for ``problem`` on ``platform``, and the
    bucket entry it used."""
    decision = active_decision(platform)
    if problem.batch_invariant and decision.ranking:
        return f"default order (batch_invariant ignores the measured table: {decision.describe()})"
    if not decision.ranking:
        return decision.describe()
    table = decision.table()
    key = nearest_bucket(table, problem)
    if key is None:
        where = f"nothing measured for shape class {shape_class(problem)}: default order"
    else:
        own = "" if key == shape_bucket(problem) else f" (nearest measured size to {shape_bucket(problem)})"
        where = f"bucket {key}{own} ranks {', '.join(table[key])}"
    return f"{where}; table: {decision.describe()}"


def state_token() -> int:
    """A hashable stand-in for the tables in use (selection's cache key): changes whenever they may have."""
    return _GENERATION


def _reset(set_to: object) -> None:
    global _SET, _GENERATION, _LAST
    _SET = set_to
    _DECISIONS.clear()
    _LAST = None
    _GENERATION += 1


def set_tuned_table(device_fingerprint: str | None, table: Mapping[str, str | Sequence[str]] | None) -> None:
    """Install a measured table (bucket -> backend, or backends fastest first) for one device in-process; None
    clears it. An explicit call wins over the files, which are then not read (and nothing is transferred) until
    :func:`reload_table`."""
    if table is None:
        _reset(None)
        return
    ranking = tuple(sorted((k, (v,) if isinstance(v, str) else tuple(v)) for k, v in table.items()))
    _reset((device_fingerprint, ranking))


def tuned_table(platform: Platform | None = None) -> tuple[str, dict[str, str]] | None:
    """The table in use as (fingerprint of the device it was measured on, {bucket: winner}): on ``platform``, else
    the one set by :func:`set_tuned_table`, else the one decided last; None where there is none."""
    if platform is not None:
        decision = active_decision(platform)
    elif _SET is not _FILES:
        return None if _SET is None else (_SET[0], {k: v[0] for k, v in _SET[1]})
    else:
        decision = _LAST
    if decision is None or not decision.ranking:
        return None
    return decision.measured_on, {k: v[0] for k, v in decision.ranking}


def reload_table(platform: Platform | None = None) -> None:
    """Forget what was loaded or set; the next selection looks for the files again (after ``tune`` wrote one, or in
    tests). With ``platform``, look now."""
    _reset(_FILES)
    if platform is not None:
        active_decision(platform)


def active_table_description(platform: Platform) -> str:
    """One line for ``info``: which measured table (or rule) orders the candidates on ``platform``, or why none."""
    return active_decision(platform).describe()


def _current_versions() -> dict[str, str]:
    import torch

    return {"mla_dispatch": __version__, "torch": torch.__version__}
