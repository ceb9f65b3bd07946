"""Making ``import flash_mla`` resolve to :mod:`mla_dispatch.compat.flash_mla` (opt-in), never over a real one.

Three ways, each explicit (importing mla_dispatch does none of them):

- in-process: :func:`install_flash_mla_alias`;
- one command: ``python -m mla_dispatch.compat.flash_mla run [--legacy] script.py ARGS``;
- every Python process of an environment: ``install-pth`` writes a ``.pth`` file and a small finder module to
  site-packages (``uninstall-pth`` removes them).

A real ``flash_mla`` (DeepSeek's FlashMLA, sgl-flash-mla, any installed package of that name) is never hidden
silently. :func:`find_installed_flash_mla` looks for one the way ``import flash_mla`` would (an imported module,
then every finder on ``sys.meta_path`` except the alias's own; a namespace directory without ``__init__.py``
does not count). Where one exists, :func:`install_flash_mla_alias` and ``run`` leave it in place and warn
(:class:`FlashMLAShadowWarning`, naming it) unless told ``shadow_installed=True`` / ``--shadow-installed``,
which warns too; ``install-pth`` refuses; and an installed ``.pth`` finder steps aside for it at import time,
with a warning.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import sys
import sysconfig
import types
import warnings
from pathlib import Path
from typing import Optional

from mla_dispatch.compat.flash_mla.decode import flash_mla_with_kvcache
from mla_dispatch.compat.flash_mla.mega import fused_norm_rope_attn_rope_cast
from mla_dispatch.compat.flash_mla.metadata import (
    FlashMLASchedMeta,
    get_mla_decoding_metadata,
    get_mla_metadata,
    get_mla_metadata_legacy,
    has_legacy,
)
from mla_dispatch.compat.flash_mla.prefill import (
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_mla_sparse_fwd,
)

__all__ = ["FlashMLAShadowWarning", "find_installed_flash_mla", "install_flash_mla_alias",
           "uninstall_flash_mla_alias", "install_pth", "uninstall_pth", "main"]

_ALIAS_NAMES = ("flash_mla", "flash_mla.flash_mla_interface")
_PTH_NAME = "mla_dispatch_flash_mla_alias"
#: the attribute that marks the .pth file's finder (find_installed_flash_mla skips it)
_FINDER_MARK = "MLA_DISPATCH_ALIAS_FINDER"


class FlashMLAShadowWarning(UserWarning):
    """A real ``flash_mla`` is installed where the alias was asked for: it was left in place (or, with
    ``shadow_installed=True``, hidden in this process)."""


def _is_alias(module) -> bool:
    return getattr(module, "MLA_DISPATCH_ALIAS", None) is not None


def _distribution_of_flash_mla() -> str:
    """'sgl-flash-mla 1.0.0'-style names of the installed distributions that provide a top-level flash_mla."""
    try:
        names = importlib.metadata.packages_distributions().get("flash_mla", [])
        return ", ".join(f"{n} {importlib.metadata.version(n)}" for n in dict.fromkeys(names))
    except Exception:  # broken metadata must not stop the check itself
        return ""


def find_installed_flash_mla() -> Optional[str]:
    """Where a ``flash_mla`` that is not mla_dispatch's alias would be (or was) imported from, or None.

    Checks an imported ``sys.modules["flash_mla"]``, then asks every finder on ``sys.meta_path`` (path entries,
    editable-install finders, ...) except the ``.pth`` alias finder. A spec without an origin (a namespace
    directory, no ``__init__.py``) is not a package and does not count.

    Returns
    -------
    str or None
        ``"<location> (<distribution> <version>)"``, the distribution where package metadata names one.
    """
    module = sys.modules.get("flash_mla")
    where = None
    if module is not None and not _is_alias(module):
        where = getattr(module, "__file__", None) or str(list(getattr(module, "__path__", [])))
    else:
        for finder in sys.meta_path:
            if getattr(finder, _FINDER_MARK, False) or not hasattr(finder, "find_spec"):
                continue
            try:
                spec = finder.find_spec("flash_mla", None)
            except (ImportError, ValueError, AttributeError):
                continue
            if spec is not None and spec.origin not in (None, "namespace"):
                where = spec.origin
                break
    if where is None:
        return None
    dist = _distribution_of_flash_mla()
    return f"{where} ({dist})" if dist else where


def _alias_module(api: str) -> types.ModuleType:
    if api not in ("current", "legacy"):
        raise ValueError(f"api must be 'current' or 'legacy', got {api!r}")
    module = types.ModuleType("flash_mla", f"mla_dispatch's FlashMLA-compatible API ({api} convention)")
    module.__version__ = "mla_dispatch"
    exported = {
        "FlashMLASchedMeta": FlashMLASchedMeta,
        "get_mla_metadata": get_mla_metadata if api == "current" else get_mla_metadata_legacy,
        "get_mla_decoding_metadata": get_mla_decoding_metadata,
        "flash_mla_with_kvcache": flash_mla_with_kvcache,
        "flash_mla_sparse_fwd": flash_mla_sparse_fwd,
        "flash_attn_varlen_func": flash_attn_varlen_func,
        "flash_attn_varlen_qkvpacked_func": flash_attn_varlen_qkvpacked_func,
        "flash_attn_varlen_kvpacked_func": flash_attn_varlen_kvpacked_func,
        "has_legacy": has_legacy,
        "fused_norm_rope_attn_rope_cast": fused_norm_rope_attn_rope_cast,
    }
    for name, value in exported.items():
        setattr(module, name, value)
    module.__all__ = list(exported)
    module.__path__ = []  # a package, so `flash_mla.flash_mla_interface` imports
    module.flash_mla_interface = module
    module.MLA_DISPATCH_ALIAS = api
    return module


def install_flash_mla_alias(api: str = "current", *, replace: bool = True,
                            shadow_installed: bool = False) -> Optional[types.ModuleType]:
    """Make ``import flash_mla`` (and ``flash_mla.flash_mla_interface``) return this API, unless a real
    ``flash_mla`` is installed.

    Parameters
    ----------
    api : {"current", "legacy"}
        Which ``get_mla_metadata`` the alias exposes: FlashMLA's current one
        (returns a ``FlashMLASchedMeta``) or the old one (returns tensors), for
        code written against FlashMLA before Sep 2025 (e.g. older SGLang).
    replace : bool
        Replace an alias already installed (another ``api``). With False an installed alias is left alone and
        returned.
    shadow_installed : bool
        Where a real ``flash_mla`` is installed (:func:`find_installed_flash_mla`): False (default) leaves it in
        place, installs nothing and warns; True hides it in this process, and warns.

    Returns
    -------
    module or None
        The alias now in ``sys.modules["flash_mla"]``; None where a real ``flash_mla`` was left in place.

    Warns
    -----
    FlashMLAShadowWarning
        A real ``flash_mla`` is installed; the message names where and which distribution.

    Raises
    ------
    ValueError
        An unknown ``api``.
    """
    module = _alias_module(api)
    existing = sys.modules.get("flash_mla")
    if existing is not None and _is_alias(existing) and not replace:
        return existing
    real = find_installed_flash_mla()
    if real is not None:
        if not shadow_installed:
            warnings.warn(f"flash_mla is installed at {real}: mla_dispatch's FlashMLA alias was not installed, so "
                          "`import flash_mla` loads that one (call mla_dispatch.compat.flash_mla directly, or pass "
                          "shadow_installed=True / --shadow-installed to hide it in this process)",
                          FlashMLAShadowWarning, stacklevel=2)
            return None
        warnings.warn(f"flash_mla is installed at {real} and is hidden in this process by mla_dispatch's FlashMLA "
                      "alias (shadow_installed=True)", FlashMLAShadowWarning, stacklevel=2)
    for name in _ALIAS_NAMES:
        sys.modules[name] = module
    return module


def uninstall_flash_mla_alias() -> None:
    """Remove the alias from ``sys.modules`` (a real ``flash_mla`` imports again afterwards)."""
    for name in _ALIAS_NAMES:
        if _is_alias(sys.modules.get(name)):
            del sys.modules[name]


def _pth_paths(site_dir: str | None) -> tuple[Path, Path]:
    base = Path(site_dir or sysconfig.get_paths()["purelib"])
    return base / f"{_PTH_NAME}.pth", base / f"{_PTH_NAME}.py"


def _finder_source(api: str, shadow_installed: bool = False) -> str:
    # Imported at interpreter start by the .pth file: it must stay cheap, so it only installs a finder;
    # mla_dispatch (and torch) load when flash_mla is imported. It defers to any other finder that has a real
    # flash_mla (a package with an origin), with a warning, so installing FlashMLA later is never hidden; unless
    # written with shadow_installed=True (install-pth --shadow-installed), which the file says in its first line.
    how = "--shadow-installed: hides any real flash_mla" if shadow_installed else "steps aside for a real flash_mla"
    return f'''"""Written by `python -m mla_dispatch.compat.flash_mla install-pth` ({how}); remove with uninstall-pth."""
import importlib.abc
import importlib.util
import sys
import warnings


class _FlashMLAAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    {_FINDER_MARK} = True

    def _real_flash_mla(self, path, target):
        for finder in sys.meta_path:
            if getattr(finder, {_FINDER_MARK!r}, False) or not hasattr(finder, "find_spec"):
                continue
            try:
                spec = finder.find_spec("flash_mla", path, target)
            except (ImportError, ValueError, AttributeError):
                continue
            if spec is not None and spec.origin not in (None, "namespace"):
                return spec.origin
        return None

    def find_spec(self, name, path=None, target=None):
        if name == "flash_mla":
            real = None if {shadow_installed!r} else self._real_flash_mla(path, target)
            if real is not None:
                warnings.warn("flash_mla is installed at " + real + ": the mla_dispatch alias written by "
                              "`python -m mla_dispatch.compat.flash_mla install-pth` steps aside for it "
                              "(remove the alias with uninstall-pth)", stacklevel=2)
                return None
            return importlib.util.spec_from_loader(name, self)
        if name == "flash_mla.flash_mla_interface" and getattr(sys.modules.get("flash_mla"),
                                                               "MLA_DISPATCH_ALIAS", None) is not None:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        from mla_dispatch.compat.flash_mla import install_flash_mla_alias
        return install_flash_mla_alias({api!r}, replace=False, shadow_installed=True)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _FlashMLAAlias())
'''


def install_pth(api: str = "current", site_dir: str | None = None, *,
                shadow_installed: bool = False) -> tuple[Path, ...]:
    """Write ``<site-packages>/mla_dispatch_flash_mla_alias.{pth,py}``: every Python process of this environment
    then resolves ``import flash_mla`` here, as long as no real ``flash_mla`` is installed (the finder steps
    aside for one, with a warning). With ``shadow_installed=True`` the alias is written even where a real
    ``flash_mla`` is installed and hides it in every process: SGLang 0.5.23 installs sgl-flash-mla as a dependency,
    so this is how its DeepSeek-V4 decode runs on mla_dispatch (on Hopper, or where sgl-flash-mla's kernels do not
    load).

    Returns
    -------
    tuple of Path
        The two files written; empty where a real ``flash_mla`` is installed (nothing is written then).

    Warns
    -----
    FlashMLAShadowWarning
        A real ``flash_mla`` is installed; the message names it.
    """
    _alias_module(api)  # validates api
    real = find_installed_flash_mla()
    if real is not None and not shadow_installed:
        warnings.warn(f"flash_mla is installed at {real}: the .pth alias was not written (it would step aside "
                      "for it anyway); call mla_dispatch.compat.flash_mla directly, or pass shadow_installed=True "
                      "(--shadow-installed) to hide it in every process", FlashMLAShadowWarning, stacklevel=2)
        return ()
    pth, py = _pth_paths(site_dir)
    py.write_text(_finder_source(api, shadow_installed))
    pth.write_text(f"import {_PTH_NAME}\n")
    return pth, py


def uninstall_pth(site_dir: str | None = None) -> list[Path]:
    """Remove the files :func:`install_pth` wrote; returns those that existed."""
    removed = []
    for path in _pth_paths(site_dir):
        if path.exists():
            path.unlink()
            removed.append(path)
    return removed


class _OneLineParser(argparse.ArgumentParser):
    """A user mistake is one line, ``<prog>: error: <what> (see --help)``, and exit status 2 (as the tools' parser)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _run_target_problem(module: Optional[str], target: list) -> Optional[str]:
    """Why ``run``'s script or module cannot be run, or None: checked before the alias is installed, so that a
    missing file is one line and not runpy's traceback (what the script itself raises stays its own)."""
    if module:
        import importlib.util

        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a missing parent package, or a relative name
            found = False
        return None if found else f"-m {module}: no module named {module!r}"
    if not target:
        return "run needs a script path (or -m module)"
    script = Path(target[0])
    if not script.exists():
        return f"script {target[0]!r} does not exist"
    if script.is_dir() and not (script / "__main__.py").is_file():
        return f"script {target[0]!r} is a folder without __main__.py (python runs a folder through it)"
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m mla_dispatch.compat.flash_mla {run,install-pth,uninstall-pth}``.

    A user mistake (an unknown option, a script or module that is not there, an unknown ``--backend``) ends with
    one line on stderr and exit status 2; the script's own exceptions propagate as they would under ``python``.
    """
    parser = _OneLineParser(prog="python -m mla_dispatch.compat.flash_mla",
                            description="Run FlashMLA code on mla_dispatch without editing it.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a script (or -m module) with `import flash_mla` resolved to mla_dispatch")
    run.add_argument("--legacy", action="store_true", help="expose the old get_mla_metadata (returns tensors)")
    run.add_argument("--shadow-installed", action="store_true",
                     help="hide a real flash_mla installed here (by default it is left in place, with a warning)")
    run.add_argument("--backend", action="append", metavar="NAME",
                     help="let backend='auto' choose only this mla_dispatch backend (repeatable: these, in the "
                          "platform's order); default: every backend")
    run.add_argument("-m", dest="module", help="run a module instead of a script")
    run.add_argument("target", nargs=argparse.REMAINDER, help="script path (or module arguments) and its arguments")
    inst = sub.add_parser("install-pth", help="alias flash_mla in every Python process of this environment")
    inst.add_argument("--legacy", action="store_true")
    inst.add_argument("--shadow-installed", action="store_true",
                      help="write it even where a real flash_mla is installed, and hide that one in every process")
    inst.add_argument("--site-dir", help="site-packages directory (default: this interpreter's purelib)")
    uninst = sub.add_parser("uninstall-pth", help="remove what install-pth wrote")
    uninst.add_argument("--site-dir")
    args = parser.parse_args(argv)

    if args.command == "install-pth":
        written = install_pth("legacy" if args.legacy else "current", args.site_dir,
                              shadow_installed=args.shadow_installed)
        for path in written:
            print(f"wrote {path}")
        return 0 if written else 1
    if args.command == "uninstall-pth":
        removed = uninstall_pth(args.site_dir)
        print("\n".join(f"removed {p}" for p in removed) or "nothing to remove")
        return 0

    import runpy

    problem = _run_target_problem(args.module, args.target)
    if problem is None and args.backend:
        from mla_dispatch import registered_names

        unknown = [n for n in args.backend if n not in registered_names()]
        if unknown:
            problem = (f"argument --backend: unknown backend {unknown[0]!r} (registered: "
                       f"{', '.join(registered_names())})")
    if problem:
        parser.error(problem)
    install_flash_mla_alias("legacy" if args.legacy else "current", shadow_installed=args.shadow_installed)
    from mla_dispatch import use_backends

    with use_backends(*args.backend) if args.backend else contextlib.nullcontext():
        if args.module:
            sys.argv = [args.module] + args.target
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args.target)
            runpy.run_path(args.target[0], run_name="__main__")
    return 0
