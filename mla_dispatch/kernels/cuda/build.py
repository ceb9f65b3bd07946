"""Just-in-time build of the native CUDA kernels (``python -m mla_dispatch build``).

The SM90 MLA decode family lives in ``mla_decode_sm90/`` next to this file (one folder per mainloop, shared device
code in ``common/``; docs/notes/cuda_sm90.md has the layout). It is
compiled with :func:`torch.utils.cpp_extension.load` for ``sm_90a`` against the
CUTLASS/CuTe headers of the ``nvidia-cutlass`` pip package
(``cutlass_library/source/include``). The extension name carries a hash of every
source and header, so a changed source gives a fresh build and an unchanged one
loads from the cache (``$MLA_DISPATCH_CACHE`` or ``~/.cache/mla_dispatch``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pathlib
import shutil
import warnings

try:
    import fcntl
except ImportError:  # not POSIX: builds are not serialised and a killed build's lock file is not cleared
    fcntl = None

__all__ = ["KernelBuildError", "SM90_SOURCE_DIR", "SM90_KERNEL_SOURCES", "nvcc_path", "cutlass_include_dir", "nvcc_flags",
           "load_sm90"]

SM90_SOURCE_DIR = pathlib.Path(__file__).resolve().parent / "mla_decode_sm90"
#: The kernel translation units (no torch): the launcher, the split-KV schedule of a plan, and each mainloop's kernel
#: instances, one file per (q dtype, cache format) it takes in its folder (``<mainloop>/*.cu``; the build compiles
#: them in parallel). The shared device code in ``common/`` is headers only.
SM90_KERNEL_SOURCES = ("launch.cu", "schedule.cu",
                       *sorted(f.relative_to(SM90_SOURCE_DIR).as_posix() for f in SM90_SOURCE_DIR.glob("*/*.cu")))
_SM90_SOURCES = ("binding.cpp", *SM90_KERNEL_SOURCES)
SM90_GENCODE = "-gencode=arch=compute_90a,code=sm_90a"


class KernelBuildError(RuntimeError):
    """The CUDA kernels could not be built (missing nvcc/CUTLASS, compiler error); the text says why."""


def nvcc_path() -> str | None:
    """Path of nvcc: ``$CUDA_HOME/bin/nvcc`` if set, else the one on PATH."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (pathlib.Path(home) / "bin" / "nvcc").exists():
        return str(pathlib.Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cutlass_include_dir() -> str:
    """The CUTLASS/CuTe include folder shipped by the ``nvidia-cutlass`` package."""
    try:
        import cutlass_library
    except ImportError as exc:
        raise KernelBuildError(
            "the CUDA kernels need the CUTLASS/CuTe headers from the nvidia-cutlass package "
            f"(pip install 'mla-dispatch[cuda]'): import cutlass_library failed: {exc}"
        ) from exc
    inc = pathlib.Path(cutlass_library.__file__).resolve().parent / "source" / "include"
    if not (inc / "cute").is_dir():
        raise KernelBuildError(f"nvidia-cutlass is installed but has no headers at {inc}")
    return str(inc)


def nvcc_flags() -> list[str]:
    """nvcc flags of the SM90 family (also used by the CI compile check)."""
    return ["-std=c++17", "-O3", SM90_GENCODE, "-lineinfo", "--expt-relaxed-constexpr",
            "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"]


def _source_hash() -> str:
    h = hashlib.sha256()
    for path in sorted(SM90_SOURCE_DIR.rglob("*")):
        if path.suffix in (".cu", ".cuh", ".h", ".cpp"):
            h.update(path.relative_to(SM90_SOURCE_DIR).as_posix().encode())
            h.update(path.read_bytes())
    h.update(" ".join(nvcc_flags()).encode())
    return h.hexdigest()[:12]


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("MLA_DISPATCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mla_dispatch")
    return pathlib.Path(root)


@contextlib.contextmanager
def _build_lock(build_dir: pathlib.Path):
    """Hold an exclusive advisory lock on ``build_dir`` for one build (or cache load) of its extension.

    ``torch.utils.cpp_extension.load`` guards a build with a ``lock`` file it deletes when it finishes or raises
    (Ctrl-C included); a build killed by a signal (``timeout``, ``kill``, the out-of-memory killer) leaves the file
    behind, and every later build of the same extension waits on it forever. Our builds hold a ``flock`` as well,
    which the OS releases when its holder dies, so once we have it no build of ours is running and a ``lock`` file
    found then is stale: it is removed, with a warning.
    """
    if fcntl is None:
        yield
        return
    with open(build_dir / "mla_dispatch.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                stale.unlink()
                warnings.warn(f"removed {stale}, left by a build that did not finish", RuntimeWarning, stacklevel=3)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.lru_cache(maxsize=1)
def load_sm90(verbose: bool = False):
    """Build (or load from the cache) the SM90 extension and return its Python module.

    Loading registers ``torch.ops.mla_dispatch.cuda_sm90_decode``; the module holds the same function for
    eager calls without the dispatcher (``module.cuda_sm90_decode``).

    Raises
    ------
    KernelBuildError
        nvcc or the CUTLASS headers are missing, or compilation failed (the
        compiler's message is included).
    """
    nvcc = nvcc_path()
    if nvcc is None:
        raise KernelBuildError(
            "building the cuda_sm90 kernel needs nvcc (CUDA >= 12.4) on PATH or under $CUDA_HOME; none was found"
        )
    import torch
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        raise KernelBuildError(f"torch {torch.__version__} is a CPU-only build; the cuda_sm90 kernel needs CUDA torch")
    include = cutlass_include_dir()
    name = f"mla_dispatch_cuda_sm90_{_source_hash()}"
    build_dir = _cache_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("CUDA_HOME", str(pathlib.Path(nvcc).resolve().parent.parent))
    try:
        with _build_lock(build_dir):
            module = cpp_extension.load(
                name=name,
                sources=[str(SM90_SOURCE_DIR / s) for s in _SM90_SOURCES],
                extra_include_paths=[str(SM90_SOURCE_DIR), include],
                # binding.cpp takes torch's own language standard (C++17 in torch 2.11, C++20 from 2.13; 2.14's
                # headers refuse anything older); the .cu units include no torch header (nvcc_flags: C++17)
                extra_cflags=["-O3"],
                extra_cuda_cflags=nvcc_flags(),
                build_directory=str(build_dir),
                is_python_module=True,
                verbose=verbose,
            )
    except Exception as exc:  # compiler output is in the exception text
        raise KernelBuildError(f"building the cuda_sm90 kernel failed: {type(exc).__name__}: {exc}") from exc
    return module
