"""``python -m mla_dispatch <command>``: each command lives in its own module,
imported only when run, and parses its own arguments (``tools/args.py``: a user mistake is one line on stderr
and exit status 2). :func:`main` returns the exit status; it raises no ``SystemExit``."""

from __future__ import annotations

import importlib
import os
import sys

COMMANDS = {
    "info": ("mla_dispatch.tools.info", "platform, backends and why each can or cannot run"),
    "demo": ("mla_dispatch.tools.demo", "a DeepSeek-V3-shaped decode step on the best backend here, checked"),
    "build": ("mla_dispatch.tools.build", "compile the native CUDA (SM90) extension ahead of time"),
    "bench": ("mla_dispatch.tools.bench", "time every available backend on a named grid against the roofline"),
    "conformance": ("mla_dispatch.tools.conformance", "check every available backend against the reference"),
    "tune": ("mla_dispatch.tools.tune", "measure backends and write this device's dispatch table"),
}


def _usage() -> str:
    rows = "\n".join(f"  {name:<12} {desc}" for name, (_, desc) in COMMANDS.items())
    return f"usage: python -m mla_dispatch <command> [options]\n\ncommands:\n{rows}\n\n<command> --help for its options"


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (``| head``): say nothing more. stdout now points at devnull, so the interpreter's
        # flush at exit does not raise again (the recipe of the Python docs, "Note on SIGPIPE").
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout without a file descriptor (captured in-process)
            pass
        return 1


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"python -m mla_dispatch: error: unknown command {name!r} (commands: {', '.join(COMMANDS)}; "
              f"see --help)", file=sys.stderr)
        return 2
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"'{name}' is not available in this version ({module_name} is not installed)", file=sys.stderr)
        return 2
    try:
        return int(module.main(rest) or 0)
    except SystemExit as exc:  # argparse's --help (0) and its one-line usage errors (2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
