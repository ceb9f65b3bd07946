"""What the commands' arguments share: a parser whose errors are one line, the argument types, and the checks
that need torch (devices, backend names).

A user mistake ends a command with one line on stderr that names the argument and what it expects, and exit
status 2; never a traceback. Errors argparse finds itself (a bad int, an unknown option) go through
:meth:`CommandParser.error`; those found after parsing raise :class:`UsageError`, which each command's ``main``
turns into the same line with :func:`usage_error`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import torch

__all__ = ["UsageError", "CommandParser", "positive_int", "nonnegative_int", "positive_float", "nonnegative_float",
           "int_list", "seed_int", "comma_items",
           "parse_device", "backend_names", "backend_spec", "writable_file", "writable_dir", "usage_error"]


class UsageError(Exception):
    """A user mistake found after parsing; the text names the argument and what is expected."""


class CommandParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (``<prog>: error: <what> (see --help)``), exit 2.

    A value that starts with a minus sign and a digit is the option's value (``--lengths -5,10`` reaches the
    option's type, which names what is wrong), where argparse alone would take ``-5,10`` for an option and say
    "expected one argument".
    """

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        joined, i = [], 0
        while i < len(args):
            arg = args[i]
            action = self._option_string_actions.get(arg)
            if (action is not None and action.nargs is None and i + 1 < len(args)
                    and re.match(r"-\.?\d", args[i + 1])):
                joined.append(f"{arg}={args[i + 1]}")
                i += 2
                continue
            joined.append(arg)
            if arg == "--":
                joined += args[i + 1:]
                break
            i += 1
        return super().parse_known_args(joined, namespace)


def usage_error(prog: str, exc: UsageError) -> int:
    """Print ``exc`` as the one line of a user mistake; returns the exit status (2)."""
    print(f"{prog}: error: {exc}", file=sys.stderr)
    return 2


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def seed_int(text: str) -> int:
    """argparse type: a random seed torch takes, an integer in [-2**63, 2**63 - 1] (``manual_seed`` overflows past
    its 64 bits; the commands add small offsets to it)."""
    value = _int(text)
    if not -(1 << 63) <= value < (1 << 63):
        raise argparse.ArgumentTypeError(f"expected an integer in [-2**63, 2**63 - 1], got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 0, at least one (``1000,37,0``)."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0 (e.g. 1000,37,0), got {text!r}")
    return values


def parse_device(text: str | None, option: str = "--device") -> torch.device:
    """The torch device ``text`` names (default: cuda if available, else cpu), checked to exist here.

    Raises UsageError for a string torch does not parse, or a device this process cannot use.
    """
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UsageError(f"argument {option}: {text!r} is not a torch device (expected cpu, cuda or cuda:<index>)"
                         ) from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None and torch.version.hip is None else "no GPU visible"
            raise UsageError(f"argument {option}: {text!r} requested, but torch {torch.__version__} sees no CUDA "
                             f"device ({build}); use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UsageError(f"argument {option}: {text!r} requested, but torch sees {count} CUDA device(s) "
                             f"(cuda:0..cuda:{count - 1})")
        return device
    module = getattr(torch, device.type, None)
    is_available = getattr(module, "is_available", None)
    if not callable(is_available) or not is_available():
        raise UsageError(f"argument {option}: {text!r} requested, but no {device.type} device is available here "
                         f"(expected cpu or cuda)")
    return device


def backend_spec(spec: str) -> tuple[str, dict[str, object]]:
    """``"name"`` or ``"name:key=value:..."`` -> ``(name, options)``; a value is an int, ``true`` / ``false``, or a
    string (``cuda_sm90:variant=6``, ``triton:batch_invariant=true:split_tokens=2048``)."""
    name, *pairs = spec.split(":")
    options: dict[str, object] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        options[key] = int(value) if re.fullmatch(r"-?\d+", value) else {"true": True, "false": False}.get(value, value)
    return name, options


def comma_items(text: str) -> list[str]:
    """The non-empty items of a comma-separated option value, stripped (``" a, ,b"`` -> ``["a", "b"]``)."""
    return [item.strip() for item in text.split(",") if item.strip()]


def backend_names(text: str | None, option: str = "--backends", also: tuple[str, ...] = (),
                  specs: bool = False) -> list[str] | None:
    """Comma-separated backend names, each checked against the registry (and ``also``, names the command takes
    besides, e.g. bench's ``auto``); None where ``text`` is None. With ``specs``, a name may carry options,
    ``name:key=value:...`` (:func:`backend_spec`; the command checks the options when it plans).

    Raises UsageError for an unknown name or a list that names none.
    """
    from mla_dispatch.dispatch.registry import registered_names

    if text is None:
        return None
    names = comma_items(text)
    known = tuple(also) + registered_names()
    if not names:
        raise UsageError(f"argument {option}: expected comma-separated backend names ({', '.join(known)}), "
                         f"got {text!r}")
    for name in names:
        base = backend_spec(name)[0] if specs else name
        if base not in known:
            raise UsageError(f"argument {option}: unknown backend {base!r} (registered: {', '.join(known)})")
    return names


def _folder_problem(path: Path) -> str | None:
    """Why folder ``path`` cannot be created (if missing) and written, or None; creates it."""
    for parent in (path, *path.parents):
        if parent.exists():
            if not parent.is_dir():
                return f"{str(parent)!r} is a file, not a folder"
            break
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create folder {str(path)!r}: {exc.strerror or exc}"
    if not os.access(path, os.W_OK):
        return f"folder {str(path)!r} is not writable"
    return None


def writable_dir(text: str, option: str) -> Path:
    """The folder ``text``, created if missing, checked writable before any work is done.

    Raises UsageError if it cannot be created or written.
    """
    path = Path(text)
    problem = _folder_problem(path)
    if problem:
        raise UsageError(f"argument {option}: cannot write to {text!r}: {problem}")
    return path


def writable_file(text: str, option: str) -> Path:
    """The file path ``text``, its folder created if missing and checked writable before any work is done.

    Raises UsageError if the folder cannot be created or written, or ``text`` names a folder.
    """
    path = Path(text)
    problem = f"{text!r} is a folder" if path.is_dir() else _folder_problem(path.parent)
    if problem:
        raise UsageError(f"argument {option}: cannot write {text!r}: {problem}")
    return path
