"""CPU checks of the native SM90 kernel: it compiles for sm_90a (nvcc, no GPU
needed), the build reports a missing nvcc clearly, and the backend declares
what it supports."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import shutil
import subprocess

import pytest
import torch

from mla_dispatch.kernels.cuda import build


def test_each_source_gets_its_own_object_in_torchs_build(tmp_path, monkeypatch):
    """torch's ``cpp_extension.load`` writes one ninja build in one folder and names each object after its source's
    base name (``<stem>.cuda.o``): two instance files of one name in two mainloop folders make ninja refuse the whole
    build ("multiple rules generate bf16_kv16.cuda.o", the H200 of 2026-11-29 on the first folder layout, which the
    compile checks here missed: they compile each file on their own). The stems are distinct, and torch's own ninja
    writer, where this torch has it, gives every source its own object."""
    import collections
    import pathlib

    stems = collections.Counter(pathlib.PurePosixPath(s).stem + pathlib.PurePosixPath(s).suffix.replace(".cpp", "")
                                for s in build._SM90_SOURCES)
    assert [s for s, n in stems.items() if n > 1] == []
    from torch.utils import cpp_extension

    writer = getattr(cpp_extension, "_write_ninja_file_to_build_library", None)
    nvcc = build.nvcc_path()
    if writer is None or nvcc is None:
        pytest.skip("torch's private ninja writer or nvcc is missing here: the stems' check above is what ran")
    monkeypatch.setenv("CUDA_HOME", str(pathlib.Path(nvcc).resolve().parent.parent))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(pathlib.Path(nvcc).resolve().parent.parent), raising=False)
    ninja = tmp_path / "build.ninja"
    import inspect

    arguments = dict(path=str(ninja), name="mla_dispatch_cuda_sm90_check",
                     sources=[str(build.SM90_SOURCE_DIR / s) for s in build._SM90_SOURCES], extra_cflags=["-O3"],
                     extra_cuda_cflags=build.nvcc_flags(), extra_sycl_cflags=[], extra_ldflags=[],
                     extra_include_paths=[str(build.SM90_SOURCE_DIR)], with_cuda=True, with_sycl=False,
                     is_standalone=False)
    accepted = inspect.signature(writer).parameters  # (torch 2.11 has no SYCL arguments)
    writer(**{k: v for k, v in arguments.items() if k in accepted})
    outputs = [line.split(":")[0].split()[1] for line in ninja.read_text().splitlines()
               if line.startswith("build ") and (".o:" in line)]
    assert len(outputs) == len(build._SM90_SOURCES)
    assert len(set(outputs)) == len(outputs), sorted(o for o in outputs if outputs.count(o) > 1)


def test_kernel_sources_compile_for_sm90a(tmp_path):
    """The kernel translation units compile for sm_90a, in parallel (as many at once as the machine has cores).

    Every unit to an sm_90a object takes minutes of a 2-core CI machine (~160 s when they were nine), most of the
    test command's budget, and most of it is NVVM's optimiser and ptxas. So by default the launcher goes all the way
    to an object and every instance file through nvcc's front end to sm_90a PTX with NVVM's optimiser off
    (``-Xcicc -O0``: every template instantiated and checked); ptxas on the optimised code runs in every extension
    build on the GPU machine. The instance files of one mainloop's folder go through the front end together, one
    unit that includes them all (parsing the CUTLASS/CuTe headers is most of a file's ~5 s: 24 files took ~55 s of a
    2-core machine, 6 units ~14 s); each file is compiled on its own by the extension build.
    ``MLA_COMPILE_ALL=1`` compiles every unit to an optimised object, on its own, as the build does."""
    import os

    nvcc = build.nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not found (needs CUDA >= 12.4): the sm_90a compile check cannot run here")
    include = build.cutlass_include_dir()
    assert len(build.SM90_KERNEL_SOURCES) > 1 and build.SM90_KERNEL_SOURCES[0] == "launch.cu"
    everything = os.environ.get("MLA_COMPILE_ALL") == "1"
    flags = build.nvcc_flags()
    ptx_flags = ["-arch=compute_90a", "--ptx", "-Xcicc", "-O0",
                 *(f for f in flags if not f.startswith("-gencode") and f not in ("-O3", "-lineinfo"))]
    if everything:
        units = {source: [source] for source in build.SM90_KERNEL_SOURCES}
    else:  # launch.cu and schedule.cu on their own, each mainloop folder's instance files in one unit
        units = {}
        for source in build.SM90_KERNEL_SOURCES:
            units.setdefault(source.split("/")[0] if "/" in source else source, []).append(source)

    def compile_unit(name):
        sources = units[name]
        full = everything or name == "launch.cu"
        if len(sources) == 1:
            path = build.SM90_SOURCE_DIR / sources[0]
        else:
            path = tmp_path / f"{name}_all.cu"
            path.write_text("".join(f'#include "{source}"\n' for source in sources))
        obj = tmp_path / (name.replace("/", "_") + (".o" if full else ".ptx"))
        cmd = [nvcc, *(["-c"] if full else []), str(path), "-o", str(obj),
               "-I", str(build.SM90_SOURCE_DIR), "-I", include,
               *(["-Xptxas=-warn-spills", *flags] if full else ptx_flags)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
        return name, obj, full, proc

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        results = list(pool.map(compile_unit, units))
    assert sum(map(len, units.values())) == len(build.SM90_KERNEL_SOURCES)
    for name, obj, full, proc in results:
        output = proc.stdout
        assert proc.returncode == 0, f"nvcc failed on {name} ({', '.join(units[name])}):\n{output}"
        assert obj.stat().st_size > 0
        cuobjdump = shutil.which("cuobjdump")
        if full and cuobjdump and name != "launch.cu":  # the instances carry sm_90a machine code
            listing = subprocess.run([cuobjdump, "--list-elf", str(obj)], capture_output=True, text=True)
            assert "sm_90a" in listing.stdout, listing.stdout + listing.stderr
        if not full:
            ptx = obj.read_text()
            # at least one kernel per instance file (a file instantiates its mainloop for one (q dtype, format))
            assert ".target sm_90a" in ptx and ptx.count(".entry") >= len(units[name]), \
                f"{name}: {ptx.count('.entry')} sm_90a kernels in its PTX for {len(units[name])} files"


def test_build_lock_clears_the_lock_file_of_a_killed_build(tmp_path):
    """torch's ``lock`` file, left by a build that was killed, would make every later build wait forever."""
    pytest.importorskip("fcntl")
    (tmp_path / "lock").write_text("")
    with pytest.warns(RuntimeWarning, match="did not finish"):
        with build._build_lock(tmp_path):
            assert not (tmp_path / "lock").exists()


def test_build_lock_is_exclusive_and_released(tmp_path):
    fcntl = pytest.importorskip("fcntl")
    with build._build_lock(tmp_path):
        with open(tmp_path / "mla_dispatch.flock") as other:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with pytest.raises(ValueError, match="boom"):
        with build._build_lock(tmp_path):
            raise ValueError("boom")  # a failed build releases the lock too
    with open(tmp_path / "mla_dispatch.flock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_missing_nvcc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(build, "nvcc_path", lambda: None)
    with pytest.raises(build.KernelBuildError, match="needs nvcc"):
        build.load_sm90.__wrapped__()


def test_build_cli_reports_failure(monkeypatch, capsys):
    """``python -m mla_dispatch build`` reaches the kernel's build through the backend (tools/build.py)."""
    from mla_dispatch.tools.cli import main

    monkeypatch.setattr(build, "nvcc_path", lambda: None)
    build.load_sm90.cache_clear()
    assert main(["build"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m mla_dispatch build: error: cuda_sm90: ") and "needs nvcc" in err
    assert len(err.splitlines()) == 1
    build.load_sm90.cache_clear()


def test_backend_declares_capabilities_and_reasons():
    from mla_dispatch.dispatch.backend import ReasonCode
    from mla_dispatch.dispatch.platform import Platform
    from mla_dispatch.dispatch.problem import DecodeProblem
    from mla_dispatch.dispatch.registry import get_backend

    cls = get_backend("cuda_sm90")
    assert cls.NAME == "cuda_sm90"
    assert cls.KV_FORMATS == {"bf16", "fp16", "fp8_e4m3", "fp8_ds_mla", "fp8_ds_v4"}
    problem = DecodeProblem(batch=2, q_len=1, num_heads_q=16, num_heads_kv=1, head_dim_qk=512, head_dim_v=512,
                            page_size=16, max_blocks=4, q_dtype=torch.float32, kv_format="bf16", causal=False,
                            topk=8, return_lse=True, device_type="cpu", batch_invariant=True)
    problem = dataclasses.replace(problem, batch=40000, q_len=2)  # sparse, batch-invariant: 80000 requests
    codes = {r.code for r in cls.not_supported_reasons(problem, Platform(kind="cpu", name="cpu", capability=None, arch="cpu", num_compute_units=2))}
    assert {ReasonCode.DEVICE, ReasonCode.DTYPE, ReasonCode.HEAD_DIM, ReasonCode.FEATURE} <= codes
    if not torch.cuda.is_available():
        reasons = cls.availability_reasons()
        assert reasons and reasons[0].code is ReasonCode.UNAVAILABLE


def test_variant_choice_follows_the_measurements():
    """v5 only where it measured faster (128 rows, or 17-64 rows with a 16-bit cache (H200), >= 32 requests with >= 24 KV chunks per part, page % 64 == 0,
    bf16/fp16 cache, q_len <= 64), and v9 there for fp8_e4m3 caches; v8 for fp8_e4m3 caches with <= 16 query rows per KV head and >= 4 chunks per part,
    17-32 rows and >= 12, on pages of whole tiles (v7 on others);
    v6 for <= 16 query rows per KV head with >= 16 chunks per part (bf16/fp16) or >= 4 (fp8_ds_mla), and 17-32 rows
    with >= 96 chunks per part (bf16/fp16 only). Each cut is pinned from both sides."""
    from mla_dispatch.backends import cuda_sm90
    from mla_dispatch.dispatch.problem import DecodeProblem


    def problem(batch=128, q_len=1, h_q=128, page_size=64, kv_format="bf16"):
        return DecodeProblem(batch=batch, q_len=q_len, num_heads_q=h_q, num_heads_kv=1, head_dim_qk=576,
                             head_dim_v=512, page_size=page_size, max_blocks=64, q_dtype=torch.bfloat16,
                             kv_format=kv_format, causal=False, topk=0, return_lse=True, device_type="cuda")

    choose = cuda_sm90.choose_variant
    assert choose(problem(), num_parts=66, max_chunks=128 * 64) == 5
    assert choose(problem(q_len=2, page_size=256), num_parts=33, max_chunks=128 * 256) == 5
    assert choose(problem(h_q=64), num_parts=132, max_chunks=128 * 64) == 5  # one 64-row tile, H200
    assert choose(problem(h_q=64, kv_format="fp8_e4m3"), num_parts=132, max_chunks=128 * 64) == 2  # not measured
    assert choose(problem(h_q=64, batch=31), num_parts=132, max_chunks=132 * 64) == 2  # the batch cut
    assert choose(problem(batch=32), num_parts=66, max_chunks=32 * 64) == 5  # 31 chunks per part
    assert choose(problem(batch=8), num_parts=66, max_chunks=8 * 128) == 2  # 15.5 chunks per part
    assert choose(problem(batch=16), num_parts=66, max_chunks=16 * 512) == 2  # long, but few requests
    assert choose(problem(h_q=1, q_len=128), num_parts=66, max_chunks=128 * 64) == 2  # q_len > 64
    assert choose(problem(page_size=16), num_parts=66, max_chunks=128 * 64) == 2  # a tile spans pages
    assert choose(problem(kv_format="fp8_e4m3"), num_parts=66, max_chunks=128 * 64) == 9  # v5's place, fp8_e4m3
    assert choose(problem(kv_format="fp8_e4m3", page_size=32), num_parts=66, max_chunks=128 * 64) == 2
    assert choose(problem(kv_format="fp8_e4m3", batch=8), num_parts=66, max_chunks=8 * 128) == 2
    assert choose(problem(kv_format="fp8_ds_mla"), num_parts=66, max_chunks=128 * 64) == 2
    assert choose(problem(), num_parts=66, max_chunks=66 * 23) == 2  # the cut: 24 chunks per part
    assert choose(problem(), num_parts=66, max_chunks=66 * 24) == 5
    assert choose(problem(batch=31), num_parts=66, max_chunks=66 * 64) == 2  # and 32 requests
    assert choose(problem(h_q=16, batch=64), num_parts=132, max_chunks=64 * 128) == 6  # 62 chunks per part
    assert choose(problem(h_q=16), num_parts=132, max_chunks=132 * 16) == 6  # the cut for 16 rows, bf16
    assert choose(problem(h_q=16), num_parts=132, max_chunks=132 * 16 - 1) == 2
    assert choose(problem(h_q=8, batch=1), num_parts=64, max_chunks=64) == 2  # b = 1: one chunk per part
    assert choose(problem(h_q=16, kv_format="fp8_ds_mla"), num_parts=132, max_chunks=132 * 4) == 6  # fp8 cut
    assert choose(problem(h_q=16, kv_format="fp8_e4m3"), num_parts=132, max_chunks=132 * 4 - 1) == 2
    assert choose(problem(h_q=16, q_len=2, page_size=16), num_parts=132, max_chunks=132 * 96) == 6  # 32 rows
    assert choose(problem(h_q=32), num_parts=132, max_chunks=132 * 96 - 1) == 5
    assert choose(problem(h_q=32), num_parts=132, max_chunks=132 * 24 - 1) == 2  # v5's chunk cut
    assert choose(problem(h_q=32, batch=64), num_parts=132, max_chunks=64 * 128) == 5  # 62 chunks per part
    assert choose(problem(h_q=16, batch=64, page_size=16), num_parts=132, max_chunks=132 * 15) == 2  # 16 rows
    assert choose(problem(h_q=16, q_len=3), num_parts=132, max_chunks=132 * 512) == 5  # 48 rows
    assert choose(problem(h_q=16, q_len=3, page_size=32), num_parts=132, max_chunks=132 * 512) == 2
    assert choose(problem(h_q=16, kv_format="fp8_e4m3"), num_parts=132, max_chunks=132 * 4) == 8  # v7's cut, v8
    assert choose(problem(h_q=32, kv_format="fp8_e4m3"), num_parts=132, max_chunks=132 * 12) == 8  # 32 rows
    assert choose(problem(h_q=16, kv_format="fp8_e4m3", page_size=32), num_parts=132, max_chunks=132 * 8) == 7
    assert choose(problem(h_q=16, kv_format="fp8_e4m3", page_size=128), num_parts=132, max_chunks=132 * 4) == 8
    assert choose(problem(h_q=32, kv_format="fp8_e4m3"), num_parts=132, max_chunks=132 * 12 - 1) == 2
    assert choose(problem(h_q=32, kv_format="fp8_ds_mla"), num_parts=132, max_chunks=132 * 512) == 2  # v7: e4m3 only
    assert choose(problem(h_q=48, kv_format="fp8_e4m3"), num_parts=132, max_chunks=132 * 512) == 2  # 48 rows
    for p, parts in [(problem(), 66), (problem(h_q=16, kv_format="fp8_e4m3"), 132), (problem(q_len=80, h_q=1), 66)]:
        for chunks in (1, 23 * parts, 512 * parts):
            variant = choose(p, num_parts=parts, max_chunks=chunks)
            assert not cuda_sm90.MAINLOOPS[variant].reasons(p), (p, chunks, variant)  # never one that cannot run it




def test_schedule_overhead_per_mainloop():
    """v2 items are charged 2 chunks, the other mainloops 5 (experiments override it per plan through
    backend_options, tests/test_cuda_sm90_plan.py)."""
    from mla_dispatch.backends.cuda_sm90 import CudaSM90Backend

    assert [CudaSM90Backend.schedule_overhead(v) for v in (2, 5, 6, 1)] == [2, 5, 5, 5]
