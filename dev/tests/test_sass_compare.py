"""dev/sass_compare.py's comparison: kernels matched by demangled name after the renames, SASS compared with blanks
collapsed, ptxas lines compared; a changed instruction, a changed register count and a missing kernel are seen."""

import importlib.util
import pathlib
import shutil
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "sass_compare.py"
_spec = importlib.util.spec_from_file_location("sass_compare", _PATH)
sass_compare = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("sass_compare", sass_compare)
_spec.loader.exec_module(sass_compare)

pytestmark = pytest.mark.skipif(shutil.which("c++filt") is None, reason="needs c++filt (binutils)")

OLD_NAME = "_ZN8mla_sm9020mla_decode_kernel_v2I13__nv_bfloat16Li0ELb0EEEvNS_12DecodeParamsE"
NEW_NAME = "_ZN8mla_sm9016mla_decode_wgmmaI13__nv_bfloat16Li0ELb0EEEvNS_12DecodeParamsE"
RENAME = [("mla_decode_kernel_v2<", "mla_decode_wgmma<")]


def _write(folder: pathlib.Path, name: str, body: str, registers: int = 168) -> None:
    folder.mkdir()
    (folder / "unit.cu.o.sass").write_text(
        f"\n\tcode for sm_90a\n\t\tFunction : {name}\n{body}\n\t\t..........\n")
    (folder / "unit.cu.o.ptxas.txt").write_text(
        f"ptxas info    : Compiling entry function '{name}' for 'sm_90a'\n"
        f"ptxas info    : Function properties for {name}\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        f"ptxas info    : Used {registers} registers, used 1 barriers\n")


BODY = "        /*0000*/   LDC R1, c[0x0][0x28] ;\n        /*0010*/   S2R R5, SR_CTAID.X ;"


def test_a_renamed_kernel_with_the_same_code_is_the_same(tmp_path, capsys):
    _write(tmp_path / "old", OLD_NAME, BODY)
    _write(tmp_path / "new", NEW_NAME, BODY.replace("   ", "      "))  # column padding differs
    assert sass_compare.compare(tmp_path / "old", tmp_path / "new", RENAME) == 0
    assert "SASS identical: 1; problems: 0" in capsys.readouterr().out
    assert sass_compare.compare(tmp_path / "old", tmp_path / "new", []) == 1  # without the rename: two kernels


@pytest.mark.parametrize("change", ["instruction", "registers"])
def test_a_change_is_seen(tmp_path, capsys, change):
    _write(tmp_path / "old", OLD_NAME, BODY)
    if change == "instruction":
        _write(tmp_path / "new", NEW_NAME, BODY.replace("SR_CTAID.X", "SR_CTAID.Y"))
    else:
        _write(tmp_path / "new", NEW_NAME, BODY, registers=170)
    assert sass_compare.compare(tmp_path / "old", tmp_path / "new", RENAME) == 1
    out = capsys.readouterr().out
    assert ("SASS differs" if change == "instruction" else "ptxas differs") in out
