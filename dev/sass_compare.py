"""Prove a change to the SM90 kernel sources changes no machine code, without a GPU.

    python dev/sass_compare.py build TREE OUT        # every kernel unit of TREE, as build.py compiles it, + SASS
    python dev/sass_compare.py compare OLD NEW [--rename 'REGEX=>REPLACEMENT' ...]

``build`` compiles each translation unit of ``TREE`` (a checkout or a ``git archive`` of one; its
``mla_dispatch/kernels/cuda/build.py`` gives the units and the flags) with nvcc, one at a time, adding ``-Xptxas -v``,
and disassembles each object with ``cuobjdump -sass`` (CUDA's, or the one bundled with triton where CUDA has none).
``compare`` matches the kernels of two such folders by demangled name (after the renames, applied to both sides:
give the old names' patterns, e.g. ``'mla_decode_kernel_v2<=>mla_decode_wgmma<'``) and reports, per kernel, whether
its SASS is the same (runs of blanks collapsed, mangled names inside the code demangled and renamed) and whether its
ptxas lines (registers, stack, spills, shared memory) are. Exit status 0 when every kernel is on both sides and the
same, 1 otherwise.

How the kernel-folder reorganisation and the port of the hidden-NaN fix onto it were checked (2026-11-29: 45 of 45
instances the same; docs/notes/cuda_sm90.md). The SASS is what runs: identical SASS is identical behaviour, so a pure
reorganisation can land without a GPU run. Not part of the product; needs nvcc, c++filt and the package's
``[cuda]`` extra (the CUTLASS headers).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig

_FUNCTION = re.compile(r"\n\s*Function : (\S+)\n")
_MANGLED = re.compile(r"_Z\w+")


def _build_module(tree: pathlib.Path):
    """``TREE``'s own ``build.py`` (its sources and flags), loaded without importing the rest of that tree."""
    path = tree / "mla_dispatch" / "kernels" / "cuda" / "build.py"
    spec = importlib.util.spec_from_file_location(f"_sass_build_{abs(hash(str(tree)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cuobjdump() -> str:
    """CUDA's cuobjdump, else the one triton bundles (CUDA 13.0's toolkit here has none)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    spec = importlib.util.find_spec("triton")
    if spec and spec.origin:
        bundled = pathlib.Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if bundled.exists():
            return str(bundled)
    raise SystemExit("sass_compare: no cuobjdump (neither CUDA's nor triton's)")


def build(tree: pathlib.Path, out: pathlib.Path, only: list[str] | None = None) -> int:
    """Compile every kernel unit of ``tree`` (or those whose path contains one of ``only``) into ``out``:
    ``<unit>.o``, ``<unit>.o.sass``, ``<unit>.o.ptxas.txt``."""
    from torch.utils import cpp_extension

    b = _build_module(tree)
    nvcc = b.nvcc_path()
    if nvcc is None:
        raise SystemExit("sass_compare: no nvcc")
    include = [str(b.SM90_SOURCE_DIR), b.cutlass_include_dir()]
    system = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    out.mkdir(parents=True, exist_ok=True)
    dump = cuobjdump()
    failed = 0
    for unit in b.SM90_KERNEL_SOURCES:
        if only and not any(text in unit for text in only):
            continue
        obj = out / (unit.replace("/", "_") + ".o")
        cmd = [nvcc, *(f"-I{p}" for p in include), *(a for p in system for a in ("-isystem", p)),
               "--compiler-options", "-fPIC", *b.nvcc_flags(), "-Xptxas", "-v", "-c", str(b.SM90_SOURCE_DIR / unit),
               "-o", str(obj)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        (obj.parent / (obj.name + ".ptxas.txt")).write_text(res.stdout + res.stderr)
        if res.returncode:
            failed += 1
            print(f"{unit}: nvcc failed (see {obj.name}.ptxas.txt)", file=sys.stderr)
            continue
        sass = subprocess.run([dump, "-sass", str(obj)], capture_output=True, text=True)
        (obj.parent / (obj.name + ".sass")).write_text(sass.stdout)
        print(f"{unit}: ok", flush=True)
    return 1 if failed else 0


def _demangle(names) -> dict[str, str]:
    names = sorted(set(names))
    if not names:
        return {}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
    return dict(zip(names, out.stdout.splitlines()))


def _renamer(renames: list[tuple[str, str]]):
    def canon(name: str) -> str:
        for pattern, replacement in renames:
            name = re.sub(pattern, replacement, name)
        return name
    return canon


def kernels(folder: pathlib.Path, canon) -> dict[str, str]:
    """``{canonical demangled name: normalised SASS}`` of a ``build`` folder (a kernel in several units once: its
    copies must agree, or the name is reported twice)."""
    found: dict[str, str] = {}
    for sass in sorted(folder.glob("*.o.sass")):
        text = sass.read_text()
        blocks = _FUNCTION.split(text)
        names = _demangle(_MANGLED.findall(text))
        for mangled, body in zip(blocks[1::2], blocks[2::2]):
            body = body.split("\n\t\t..........")[0]
            body = re.sub(r"[ \t]+", " ", body)
            body = _MANGLED.sub(lambda m: canon(names.get(m.group(0), m.group(0))), body)
            key = canon(names.get(mangled, mangled))
            if key in found and found[key] != body:
                key += f" [another copy in {sass.name}]"
            found[key] = body
    return found


def ptxas_lines(folder: pathlib.Path, canon) -> dict[str, list[str]]:
    """``{canonical name: its ptxas info lines (registers, stack, spills, smem)}``."""
    out: dict[str, list[str]] = collections.defaultdict(list)
    for log in sorted(folder.glob("*.ptxas.txt")):
        lines = log.read_text().splitlines()
        names = _demangle(re.findall(r"'(_Z\w+)'", "\n".join(lines)) +
                          re.findall(r"Function properties for (_Z\w+)", "\n".join(lines)))
        current = None
        for line in lines:
            m = re.search(r"Compiling entry function '(_Z\w+)'|Function properties for (_Z\w+)", line)
            if m:
                current = canon(names.get(m.group(1) or m.group(2), m.group(1) or m.group(2)))
                continue
            if current and re.search(r"registers|spill|stack frame|bytes smem", line):
                out[current].append(re.sub(r"^ptxas info\s*:\s*", "", line.strip()))
    return out


def compare(old: pathlib.Path, new: pathlib.Path, renames: list[tuple[str, str]]) -> int:
    canon = _renamer(renames)
    a, b = kernels(old, canon), kernels(new, canon)
    same = 0
    problems = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            problems.append(f"only in {'old' if name in a else 'new'}: {name}")
        elif a[name] == b[name]:
            same += 1
        else:
            la, lb = a[name].splitlines(), b[name].splitlines()
            differing = sum(x != y for x, y in zip(la, lb)) + abs(len(la) - len(lb))
            problems.append(f"SASS differs: {name} ({len(la)} vs {len(lb)} lines, {differing} differ)")
    pa, pb = ptxas_lines(old, canon), ptxas_lines(new, canon)
    for name in sorted(set(pa) | set(pb)):
        if sorted(set(pa.get(name, []))) != sorted(set(pb.get(name, []))):
            problems.append(f"ptxas differs: {name}: {pa.get(name)} vs {pb.get(name)}")
    print("\n".join(problems))
    print(f"kernels: {len(a)} old, {len(b)} new; SASS identical: {same}; problems: {len(problems)}")
    return 0 if not problems and len(a) == len(b) == same else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python dev/sass_compare.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pb = sub.add_parser("build", help="compile every kernel unit of a tree and disassemble it")
    pb.add_argument("tree", type=pathlib.Path)
    pb.add_argument("out", type=pathlib.Path)
    pb.add_argument("--only", default=None, metavar="TEXT",
                    help="only the units whose path contains one of these comma-separated texts (e.g. 'seesaw')")
    pc = sub.add_parser("compare", help="compare two build folders kernel by kernel")
    pc.add_argument("old", type=pathlib.Path)
    pc.add_argument("new", type=pathlib.Path)
    pc.add_argument("--rename", action="append", default=[], metavar="REGEX=>REPLACEMENT",
                    help="a rename of demangled names, applied to both sides (repeatable, in order)")
    args = p.parse_args(argv)
    if args.command == "build":
        return build(args.tree.resolve(), args.out.resolve(),
                     None if args.only is None else [t.strip() for t in args.only.split(",") if t.strip()])
    renames = []
    for text in args.rename:
        if "=>" not in text:
            p.error(f"argument --rename: expected REGEX=>REPLACEMENT, got {text!r}")
        renames.append(tuple(text.split("=>", 1)))
    return compare(args.old, args.new, renames)


if __name__ == "__main__":
    raise SystemExit(main())
