"""``python -m mla_dispatch build``: compile now what the backends would compile on their first call (today the
native CUDA kernel of ``cuda_sm90``, with nvcc >= 12.4 and CUTLASS), reaching them through the registry."""

from __future__ import annotations

import sys

from mla_dispatch.dispatch.backend import MLABackend
from mla_dispatch.dispatch.registry import get_backend, registered_names
from mla_dispatch.tools.args import CommandParser

__all__ = ["main"]


def _builds(cls: type[MLABackend]) -> bool:
    return getattr(cls.build, "__func__", None) is not MLABackend.build.__func__


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="python -m mla_dispatch build", description=__doc__)
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    failed = 0
    for name in registered_names():
        cls = get_backend(name)
        if not _builds(cls):
            continue
        try:
            built = cls.build(verbose=args.verbose)
        except RuntimeError as exc:
            print(f"{parser.prog}: error: {name}: {exc}", file=sys.stderr)
            failed += 1
            continue
        if built:
            print(f"{name}: {built}")
    return 1 if failed else 0
