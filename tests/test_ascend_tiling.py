"""The Ascend kernel's host tiling (plain C++), built with g++ and unit-tested here.

``kernels/ascend/host/tiling_test.cpp`` checks the work partition (every token
covered exactly once, block-aligned ranges, slots, balance) and that every
buffer plan fits the 910B memories (L1 512 KB, L0A/L0B 64 KB, L0C 128 KB, UB
192 KB). The CLI build is compared with ``mla_dispatch.metadata.schedule.split_kv_schedule``
so that the emulation runs exactly the partition the kernel would.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest
import torch

from mla_dispatch.metadata.schedule import split_kv_schedule

HOST = pathlib.Path(__file__).resolve().parents[1] / "mla_dispatch" / "kernels" / "ascend" / "host"
GXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ is not installed (needed to build the C++ host tiling)")
FLAGS = ["-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror"]


def _build(tmp_path, main: str) -> pathlib.Path:
    exe = tmp_path / main.replace(".cpp", "")
    subprocess.run([GXX, *FLAGS, str(HOST / "tiling.cpp"), str(HOST / main), "-o", str(exe)], check=True,
                   capture_output=True, text=True)
    return exe


def test_host_tiling_unit_tests(tmp_path, seed):
    exe = _build(tmp_path, "tiling_test.cpp")
    res = subprocess.run([str(exe), str(seed)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr + res.stdout
    assert "passed" in res.stdout


def test_host_partition_equals_the_emulation_schedule(tmp_path, gen):
    exe = _build(tmp_path, "tiling_cli.cpp")
    for _ in range(20):
        batch = int(torch.randint(1, 40, (1,), generator=gen))
        cores = int(torch.randint(1, 40, (1,), generator=gen))
        lens = torch.randint(0, 20000, (batch,), generator=gen)
        lens[torch.rand(batch, generator=gen) < 0.2] = 0
        res = subprocess.run([str(exe), str(cores), *map(str, lens.tolist())], capture_output=True, text=True,
                             check=True)
        lines = res.stdout.strip().splitlines()
        cpp_items = [tuple(map(int, line.split())) for line in lines[:-1]]
        cpp_offsets = list(map(int, lines[-1].split()[1:]))
        sched = split_kv_schedule(lens.to(torch.int32), num_parts=cores, chunk_size=512, overhead=1)
        py_items = [item for part in sched.to_list() for item in part]
        assert cpp_items == py_items, (cores, lens.tolist())
        assert cpp_offsets == sched.part_offsets.tolist()
