"""The scheduling control bits of SASS instructions: stall cycles, the dependency barriers an
instruction sets and the ones it waits on.

``cuobjdump -sass`` prints each 128-bit instruction as two 64-bit words, but not the compiler's
scheduling decisions. Those live in the top 23 bits of the second word (bits 105-127 of the
instruction): stall count (4 bits), yield (1), write barrier (3), read barrier (3), wait mask (6),
operand reuse (4). The layout is the one Jia et al. found for Volta by microbenchmarking
("Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking", 2018, arXiv:1804.06826,
chapter 2, "control information"). It holds for the sm_90a SASS of nvcc 13.0: a global load sets
write barrier k, and its first consumer waits on bit k of its mask (tests/test_sass_ctrl.py checks
this on instructions of this repository's v6 kernel).

The use: a load that waits on a barrier set by earlier loads cannot issue until those land. That
is how v6's fp8 rows came to arrive one DRAM latency apart
(docs/notes/cuda_sm90.md, "Fifth session: fp8 loads").

    cuobjdump -sass build/x.cubin > x.sass      # cuobjdump: CUDA toolkit, or the nvidia-cuda-cuobjdump wheel
    python dev/sass_ctrl.py x.sass --function 'decode_etap.*Li1EE' --grep LDG
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

__all__ = ["Control", "Instruction", "decode_control", "parse_sass"]

_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s+/\* (0x[0-9a-f]{16}) \*/")
_SECOND = re.compile(r"^\s+/\* (0x[0-9a-f]{16}) \*/")
_FUNCTION = re.compile(r"Function : (\S+)")
_NO_BARRIER = 7


@dataclasses.dataclass(frozen=True)
class Control:
    """Scheduling bits of one instruction; ``write_barrier`` / ``read_barrier`` are None when unset."""

    stall: int
    yield_flag: bool
    write_barrier: int | None
    read_barrier: int | None
    wait: frozenset[int]
    reuse: int


@dataclasses.dataclass(frozen=True)
class Instruction:
    function: str
    address: int
    text: str
    control: Control


def decode_control(second_word: int) -> Control:
    """The control bits of an instruction from the second 64-bit word cuobjdump prints for it."""
    c = second_word >> 41
    wb, rb = (c >> 5) & 7, (c >> 8) & 7
    return Control(stall=c & 15, yield_flag=bool((c >> 4) & 1),
                   write_barrier=None if wb == _NO_BARRIER else wb,
                   read_barrier=None if rb == _NO_BARRIER else rb,
                   wait=frozenset(k for k in range(6) if (c >> (11 + k)) & 1), reuse=(c >> 17) & 15)


def parse_sass(text: str) -> list[Instruction]:
    """Every instruction of a ``cuobjdump -sass`` listing, with the function it belongs to."""
    out, function = [], ""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        f = _FUNCTION.search(line)
        if f:
            function = f.group(1)
            continue
        m = _INSTR.match(line)
        if not m or i + 1 >= len(lines):
            continue
        second = _SECOND.match(lines[i + 1])
        if second:
            out.append(Instruction(function, int(m.group(1), 16), m.group(2), decode_control(int(second.group(1), 16))))
    return out


def _format(ins: Instruction) -> str:
    c = ins.control
    wb = "-" if c.write_barrier is None else f"W{c.write_barrier}"
    rb = "-" if c.read_barrier is None else f"R{c.read_barrier}"
    wait = "".join(str(k) for k in sorted(c.wait))
    return f"{ins.address:06x} stall {c.stall:2d} {wb:2s} {rb:2s} wait[{wait:6s}] {ins.text}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sass", help="a `cuobjdump -sass` listing")
    ap.add_argument("--function", default="", help="regex on the mangled function name")
    ap.add_argument("--grep", default="", help="regex on the instruction text")
    args = ap.parse_args(argv)
    with open(args.sass) as fh:
        instructions = parse_sass(fh.read())
    fn, gr = re.compile(args.function), re.compile(args.grep)
    shown = None
    for ins in instructions:
        if not fn.search(ins.function) or not gr.search(ins.text):
            continue
        if ins.function != shown:
            print(f"== {ins.function}")
            shown = ins.function
        print(_format(ins))
    if shown is None:
        print("no instruction matched", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
