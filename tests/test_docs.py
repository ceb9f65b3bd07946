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
