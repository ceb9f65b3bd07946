"""Making ``import flash_mla`` resolve to :mod:`mla_dispatch.compat.flash_mla` (opt-in)."""

from __future__ import annotations

import argparse
import sys
import sysconfig
import types
from pathlib import Path

from mla_dispatch.compat.flash_mla.decode import flash_mla_with_kvcache
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

__all__ = ["install_flash_mla_alias", "uninstall_flash_mla_alias", "install_pth", "uninstall_pth", "main"]

# --------------------------------------------------------------------------------------
# Making `import flash_mla` resolve here (opt-in)
# --------------------------------------------------------------------------------------

_ALIAS_NAMES = ("flash_mla", "flash_mla.flash_mla_interface")
_PTH_NAME = "mla_dispatch_flash_mla_alias"


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
    }
    for name, value in exported.items():
        setattr(module, name, value)
    module.__all__ = list(exported)
    module.__path__ = []  # a package, so `flash_mla.flash_mla_interface` imports
    module.flash_mla_interface = module
    module.MLA_DISPATCH_ALIAS = api
    return module


def install_flash_mla_alias(api: str = "current", *, replace: bool = True) -> types.ModuleType:
    """Make ``import flash_mla`` (and ``flash_mla.flash_mla_interface``) return this API.

    Parameters
    ----------
    api : {"current", "legacy"}
        Which ``get_mla_metadata`` the alias exposes: FlashMLA's current one
        (returns a ``FlashMLASchedMeta``) or the old one (returns tensors), for
        code written against FlashMLA before Sep 2025 (e.g. older SGLang).
    replace : bool
        Replace an already imported ``flash_mla`` (the real one included). With
        False an existing module is left alone and returned.

    Returns
    -------
    The module now in ``sys.modules["flash_mla"]``.
    """
    existing = sys.modules.get("flash_mla")
    if existing is not None and not replace:
        return existing
    module = _alias_module(api)
    for name in _ALIAS_NAMES:
        sys.modules[name] = module
    return module


def uninstall_flash_mla_alias() -> None:
    """Remove the alias from ``sys.modules`` (a real ``flash_mla`` imports again afterwards)."""
    for name in _ALIAS_NAMES:
        if getattr(sys.modules.get(name), "MLA_DISPATCH_ALIAS", None) is not None:
            del sys.modules[name]


def _pth_paths(site_dir: str | None) -> tuple[Path, Path]:
    base = Path(site_dir or sysconfig.get_paths()["purelib"])
    return base / f"{_PTH_NAME}.pth", base / f"{_PTH_NAME}.py"


def _finder_source(api: str) -> str:
    # Imported at interpreter start by the .pth file: it must stay cheap, so it
    # only installs a finder; mla_dispatch (and torch) load when flash_mla is imported.
    return f'''"""Written by `python -m mla_dispatch.compat.flash_mla install-pth`; remove with uninstall-pth."""
import importlib.abc
import importlib.util
import sys


class _FlashMLAAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name in ("flash_mla", "flash_mla.flash_mla_interface"):
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        from mla_dispatch.compat.flash_mla import install_flash_mla_alias
        return install_flash_mla_alias({api!r}, replace=False)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _FlashMLAAlias())
'''


def install_pth(api: str = "current", site_dir: str | None = None) -> tuple[Path, Path]:
    """Write ``<site-packages>/mla_dispatch_flash_mla_alias.{pth,py}``: every Python
    process of this environment then resolves ``import flash_mla`` here."""
    _alias_module(api)  # validates api
    pth, py = _pth_paths(site_dir)
    py.write_text(_finder_source(api))
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


def main(argv: list[str] | None = None) -> int:
    """``python -m mla_dispatch.compat.flash_mla {run,install-pth,uninstall-pth}``."""
    parser = argparse.ArgumentParser(prog="python -m mla_dispatch.compat.flash_mla",
                                     description="Run FlashMLA code on mla_dispatch without editing it.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a script (or -m module) with `import flash_mla` resolved to mla_dispatch")
    run.add_argument("--legacy", action="store_true", help="expose the old get_mla_metadata (returns tensors)")
    run.add_argument("-m", dest="module", help="run a module instead of a script")
    run.add_argument("target", nargs=argparse.REMAINDER, help="script path (or module arguments) and its arguments")
    inst = sub.add_parser("install-pth", help="alias flash_mla in every Python process of this environment")
    inst.add_argument("--legacy", action="store_true")
    inst.add_argument("--site-dir", help="site-packages directory (default: this interpreter's purelib)")
    uninst = sub.add_parser("uninstall-pth", help="remove what install-pth wrote")
    uninst.add_argument("--site-dir")
    args = parser.parse_args(argv)

    if args.command == "install-pth":
        for path in install_pth("legacy" if args.legacy else "current", args.site_dir):
            print(f"wrote {path}")
        return 0
    if args.command == "uninstall-pth":
        removed = uninstall_pth(args.site_dir)
        print("\n".join(f"removed {p}" for p in removed) or "nothing to remove")
        return 0

    import runpy

    install_flash_mla_alias("legacy" if args.legacy else "current")
    if args.module:
        sys.argv = [args.module] + args.target
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    else:
        if not args.target:
            parser.error("run needs a script path (or -m module)")
        sys.argv = list(args.target)
        runpy.run_path(args.target[0], run_name="__main__")
    return 0

