"""What the README tells a user agrees with the code: the sections other text points at exist and hold the command
it names."""

from __future__ import annotations

import pathlib
import re
import tomllib

from conftest import GPU_SKIP_REASON

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def readme_sections() -> dict[str, str]:
    """``{heading: body}`` of the README's ``## `` sections."""
    sections, name = {}, None
    for line in README.read_text().splitlines():
        if line.startswith("## "):
            name = line[3:].strip()
            sections[name] = ""
        elif name is not None:
            sections[name] += line + "\n"
    return sections


def _gpu_marker() -> str:
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    return next(m for m in markers if m.startswith("gpu:"))


def test_the_gpu_skip_reason_and_marker_name_a_readme_section_and_its_command():
    """A user on a CPU sees 2,500 GPU tests skipped: the reason (and ``pytest --markers``) says where to read more
    and what to run where there is a GPU, and that section exists and shows that command."""
    sections = readme_sections()
    for text in (GPU_SKIP_REASON, _gpu_marker()):
        section = re.search(r'README "([^"]+)"', text)
        assert section and section.group(1) in sections, (text, sorted(sections))
        command = re.search(r"where there is one: (python [^,(]+?)\s*[,(]", text)
        assert command, text
        assert command.group(1) in sections[section.group(1)], (command.group(1), section.group(1))


_MATRIX = re.compile(r"<!-- support matrix: [^\n]*-->\n(.*?)\n<!-- end of support matrix -->", re.S)


def test_the_readme_support_matrix_is_the_generated_one():
    """The README's table is ``python -m mla_dispatch info --markdown``, made from the backends' class data: a
    declaration that changes (a backend added, a limit found) changes the README or this test fails."""
    from mla_dispatch.tools.info import support_matrix

    found = _MATRIX.search(README.read_text())
    assert found, "README.md lost its support matrix markers"
    assert found.group(1).strip() == support_matrix(), (
        "README.md's support matrix is not the generated one: paste `python -m mla_dispatch info --markdown` between "
        "its markers")


def test_a_new_backend_and_a_new_kv_format_appear_without_editing_the_generator(monkeypatch, registered):
    """What another branch adds (a vendor adapter registered among the built-ins, a KV format) shows in the
    matrix from its class data alone: one row per ARCH_SUPPORT entry, or one row from the constants."""
    import torch

    from mla_dispatch.backends.reference import ReferenceBackend
    from mla_dispatch.dispatch.backend import ArchSupport
    from mla_dispatch.dispatch.registry import BUILTIN_BACKENDS
    from mla_dispatch.tools.info import support_matrix

    class NewVendor(ReferenceBackend):
        NAME = "test_docs_new_vendor"
        VENDOR = "Some Vendor"
        PLATFORMS = frozenset({"cuda"})
        KV_FORMATS = frozenset({"bf16", "fp8_new_format"})
        HEAD_DIMS = frozenset({(576, 512)})
        ARCH_SUPPORT = (ArchSupport("sm90", "Hopper (sm_90a)", min_capability=(9, 0), max_capability=(9, 0),
                                    limits={"NUM_HEADS_Q": frozenset({16, 64})}, notes="its kernel",
                                    run_here="yes: H200"),)

    class Plain(ReferenceBackend):
        NAME = "test_docs_plain"
        PLATFORMS = frozenset({"cuda"})
        MIN_CAPABILITY = (8, 0)
        Q_DTYPES = frozenset({torch.bfloat16})
        ARCH_SUPPORT = ()  # declares none (the reference's would be inherited)

    for cls in (NewVendor, Plain):
        monkeypatch.setitem(BUILTIN_BACKENDS, registered(cls), (f"{cls.__module__}:{cls.__qualname__}", {}))
    rows = {line.split(" | ")[0]: line for line in support_matrix().splitlines()}
    assert rows["| `test_docs_new_vendor` (Some Vendor)"] == (
        "| `test_docs_new_vendor` (Some Vendor) | Hopper (sm_90a) | its kernel; q bf16/fp16; cache bf16, fp8_new_format; "
        "D 576/512; any page size; h_q 16/64; any h_kv; any s_q; causal; dense and sparse; LSE; CUDA graph; "
        "batch-invariant | yes: H200 |")
    assert rows["| `test_docs_plain`"].startswith("| `test_docs_plain` | cuda sm80+ | q bf16; cache bf16, fp16, ")
    assert rows["| `test_docs_plain`"].endswith(" | not recorded |")


def test_adding_a_backend_names_every_part_of_the_contract():
    """docs/adding-a-backend.md names every class constant and every method a backend may declare or override, so
    a constant added to MLABackend without a word there fails here."""
    from mla_dispatch.dispatch.backend import MLABackend

    text = (ROOT / "docs" / "adding-a-backend.md").read_text()
    constants = [n for n in vars(MLABackend) if n.isupper()]
    methods = ["plan", "update", "run", "bind", "build", "extra_reasons", "version"]
    internal = {"IMPLEMENTED"}  # set by the registry's stand-ins, never by an adapter
    missing = [n for n in constants + methods if n not in internal and not re.search(rf"\b{n}\b", text)]
    assert not missing, f"docs/adding-a-backend.md does not mention: {missing}"
