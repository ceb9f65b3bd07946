"""dev/sass_ctrl.py decodes the scheduling bits of real sm_90a SASS consistently.

The fixture is four instructions that `cuobjdump -sass` printed for this repository's etap kernel
(v6; bf16 q, 16 rows, fp8_e4m3; nvcc 13.0, sm_90a; the symbol renamed from mla_decode_kernel_v6, whose SASS is
unchanged). Among them is an 8-byte global load of R96:R97 and
the first instruction that reads R97. If the bit layout the tool assumes were wrong, the load's
write barrier and the reader's wait mask would not line up.
"""

import importlib.util
import pathlib
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "sass_ctrl.py"
_spec = importlib.util.spec_from_file_location("sass_ctrl", _PATH)
sass_ctrl = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("sass_ctrl", sass_ctrl)  # dataclasses look their module up there
_spec.loader.exec_module(sass_ctrl)

FIXTURE = """
\t\tFunction : _ZN8mla_sm9015mla_decode_etapI13__nv_bfloat16Li16ELb0ELi1EEEvNS_12DecodeParamsE14CUtensorMap_st
\t.headerflags\t@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                              /* 0x00000a00ff017b82 */
                                                                                                       /* 0x000fe20000000800 */
        /*0010*/                   S2R R5, SR_CTAID.X ;                                                /* 0x0000000000057919 */
                                                                                                       /* 0x000e6e0000002500 */
        /*77e0*/                   LDG.E.64.CONSTANT R96, desc[UR38][R134.64] ;                        /* 0x0000002686607981 */
                                                                                                       /* 0x000768000c1e9b00 */
        /*a640*/                   F2FP.F16.E4M3.UNPACK_B R26, R97 ;                                   /* 0x00000061ff1a723e */
                                                                                                       /* 0x024fe400020006ff */
"""


def test_parse_reads_every_instruction_with_its_function():
    ins = sass_ctrl.parse_sass(FIXTURE)
    assert [i.address for i in ins] == [0x0, 0x10, 0x77E0, 0xA640]
    assert all("mla_decode_etap" in i.function for i in ins)
    assert ins[2].text.startswith("LDG.E.64.CONSTANT R96")


def test_a_load_and_its_consumer_meet_on_one_barrier():
    ins = {i.address: i for i in sass_ctrl.parse_sass(FIXTURE)}
    load, use = ins[0x77E0].control, ins[0xA640].control
    assert load.write_barrier is not None  # a variable-latency load must set a barrier
    assert load.write_barrier in use.wait  # the reader of R97 waits on it
    assert use.write_barrier is None  # F2FP has a fixed latency: it sets none
    s2r = ins[0x10].control  # S2R is variable-latency too
    assert s2r.write_barrier is not None


@pytest.mark.parametrize("stall,yield_flag,wb,rb,wait,reuse", [(0, False, 7, 7, 0, 0), (15, True, 5, 2, 0b101001, 9)])
def test_decode_control_fields_round_trip(stall, yield_flag, wb, rb, wait, reuse):
    c = stall | yield_flag << 4 | wb << 5 | rb << 8 | wait << 11 | reuse << 17
    got = sass_ctrl.decode_control(c << 41 | 0x1234)
    assert (got.stall, got.yield_flag, got.reuse) == (stall, yield_flag, reuse)
    assert got.write_barrier == (None if wb == 7 else wb) and got.read_barrier == (None if rb == 7 else rb)
    assert got.wait == frozenset(k for k in range(6) if wait >> k & 1)


def test_cli_filters_by_function_and_text(tmp_path, capsys):
    f = tmp_path / "x.sass"
    f.write_text(FIXTURE)
    assert sass_ctrl.main([str(f), "--function", "decode_etap", "--grep", "LDG"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("== _ZN8mla_sm90") and len(out) == 2 and "LDG.E.64" in out[1]
    assert sass_ctrl.main([str(f), "--function", "decode_seesaw"]) == 1
