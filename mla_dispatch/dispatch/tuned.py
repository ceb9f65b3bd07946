"""Measured dispatch tables: which backend was fastest, per shape bucket, on one device.

A table is a JSON document written by ``python -m mla_dispatch tune`` (:mod:`mla_dispatch.tools.tune`)::

    {"format": "mla_dispatch-tuned-table/1",
     "fingerprint": "NVIDIA H100 80GB HBM3|sm_90", "device": ..., "versions": {...},
     "created": "...", "command": "...", "metric": "run",
     "table": {"rows128-hkv1-d576x512-ps64-bf16-dense": "flashmla", ...},
     "measurements": {bucket: {backend: µs summed over the bucket's configs}}}

Selection (:mod:`mla_dispatch.dispatch.select`) asks :func:`active_table` for the table of a platform; the first
time, this module looks for the user's table (``$MLA_DISPATCH_TUNED_TABLE`` if set, else
``$XDG_CACHE_HOME/mla_dispatch/tuned-<device>.json``, ``~/.cache`` by default) and, where there is none, for a
table shipped in the package for that device (``dispatch/tables/``). It never reads a file at import. A table
measured on another device (fingerprint mismatch) is ignored; a table only reorders candidates, and feasibility
still decides (a winner that cannot run a problem is skipped).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from mla_dispatch.dispatch.platform import Platform
from mla_dispatch.dispatch.problem import DecodeProblem
from mla_dispatch.version import __version__

__all__ = ["TABLE_FORMAT", "ENV_VAR", "SHIPPED_DIR", "fingerprint", "shape_class", "shape_bucket", "lookup", "default_table_path",
           "table_path", "shipped_table_path", "read_table", "active_table", "set_tuned_table", "tuned_table",
           "reload_table", "active_table_description", "state_token"]

logger = logging.getLogger("mla_dispatch")

TABLE_FORMAT = "mla_dispatch-tuned-table/1"
ENV_VAR = "MLA_DISPATCH_TUNED_TABLE"
#: Tables measured on our own devices, shipped with the package (one file per device fingerprint).
SHIPPED_DIR = Path(__file__).resolve().parent / "tables"

# The installed table: (device fingerprint, ((bucket, backend), ...)) or None; hashable, so selection can key
# its cache on it.
_TABLE: tuple[str, tuple[tuple[str, str], ...]] | None = None
# What the lazy load found: (path looked at, document or None, note); None until the first load.
_SOURCE: tuple[Path | None, dict | None, str] | None = None
_loaded = False


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


def lookup(table: dict[str, str], problem: DecodeProblem) -> str | None:
    """The measured winner for ``problem``: its own bucket's; else that of the nearest measured size of the same
    shape class (distance: octaves of batch plus octaves of capacity; ties go to the larger size); else a
    size-less entry of the class (tables of format 1). None when the table says nothing about the class."""
    key = shape_bucket(problem)
    if key in table:
        return table[key]
    m = _SIZE.match(key)
    cls, b, cap = m["cls"], int(m["b"]), int(m["L"])
    best, best_d = None, None
    for k, name in table.items():
        km = _SIZE.match(k)
        if km is None or km["cls"] != cls:
            continue
        kb, kl = int(km["b"]), int(km["L"])
        d = (abs(kb.bit_length() - b.bit_length()) + abs(kl.bit_length() - cap.bit_length()), -kb, -kl)
        if best_d is None or d < best_d:
            best, best_d = name, d
    return best if best is not None else table.get(cls)


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


def _install(doc: dict | None) -> None:
    global _TABLE
    _TABLE = None if doc is None else (doc["fingerprint"], tuple(sorted(doc["table"].items())))


def _load(platform: Platform) -> None:
    """Look for the user's table, then the shipped one, and install the first found. Never raises: a missing file
    means the default order, an unreadable one is logged and ignored."""
    global _SOURCE, _loaded
    _loaded = True
    user = table_path(platform)
    for path in (user, shipped_table_path(platform)):
        if not path.exists():
            continue
        try:
            doc = read_table(path)
        except (OSError, ValueError) as exc:
            logger.warning("mla_dispatch: ignoring measured dispatch table: %s", exc)
            _SOURCE = (path, None, f"unreadable: {exc}")
            return
        _install(doc)
        _SOURCE = (path, doc, "loaded" if path == user else "shipped")
        return
    _SOURCE = (user, None, "no file")


def active_table(platform: Platform) -> dict[str, str] | None:
    """The measured table (bucket -> backend) selection uses on ``platform``: None where there is none for this
    device. The first call loads it (see the module docstring)."""
    if not _loaded:
        _load(platform)
    if _TABLE is None or _TABLE[0] != fingerprint(platform):
        return None
    return dict(_TABLE[1])


def state_token() -> tuple | None:
    """A hashable stand-in for the installed table (selection's cache key)."""
    return _TABLE


def set_tuned_table(device_fingerprint: str | None, table: dict[str, str] | None) -> None:
    """Install a measured table (bucket -> backend) for one device in-process; None clears it.

    An explicit call wins over the files (which are then not read).
    """
    global _loaded, _SOURCE
    _loaded = True
    _SOURCE = None
    _install(None if table is None else {"fingerprint": device_fingerprint, "table": table})


def tuned_table() -> tuple[str, dict[str, str]] | None:
    """The installed table as (device fingerprint, {bucket: backend}), or None."""
    return None if _TABLE is None else (_TABLE[0], dict(_TABLE[1]))


def reload_table(platform: Platform | None = None) -> None:
    """Forget what was loaded; the next selection looks for the files again (after ``tune`` wrote one, or in
    tests). With ``platform``, look now."""
    global _loaded, _SOURCE
    _install(None)
    _SOURCE = None
    _loaded = False
    if platform is not None:
        _load(platform)


def active_table_description(platform: Platform) -> str:
    """One line for ``info``: which measured table selection uses here, or why none."""
    active_table(platform)
    installed = tuned_table()
    if _SOURCE is None or _SOURCE[1] is None:
        if installed is not None:
            return f"set in-process by set_tuned_table() for {installed[0]} ({len(installed[1])} buckets)"
        where = _SOURCE[0] if _SOURCE is not None else table_path(platform)
        why = "" if _SOURCE is None or _SOURCE[2] == "no file" else f"; {_SOURCE[2]}"
        return (f"none (default order; looked for {where} and {shipped_table_path(platform).name} shipped"
                f"{why}; write one with `python -m mla_dispatch tune`)")
    path, doc, note = _SOURCE
    mine = fingerprint(platform)
    used = "in use" if doc["fingerprint"] == mine else f"NOT used: measured on {doc['fingerprint']}, this is {mine}"
    origin = "shipped with mla_dispatch" if note == "shipped" else "yours"
    v = doc.get("versions", {})
    stale = [f"{k} {v[k]} -> {now}" for k, now in _current_versions().items() if v.get(k) not in (None, now)]
    return (f"{path} ({origin}; {used}; {len(doc['table'])} buckets, {doc.get('created', '?')}, "
            f"metric {doc.get('metric', '?')}" + (f"; versions changed since: {', '.join(stale)}" if stale else "")
            + ")")


def _current_versions() -> dict[str, str]:
    import torch

    return {"mla_dispatch": __version__, "torch": torch.__version__}
