"""The Triton kernel under Triton's CPU interpreter (CI), against the reference.

``TRITON_INTERPRET=1`` must be set before triton is imported, so the cases run
in one child process (``python tests/test_triton_interpret.py SEED``) that
prints one JSON line per case; each parametrized test checks its line. Nothing
leaks into this process's environment.

fp16 only: ``tl.dot`` on bf16 operands is wrong in the interpreter (docs/design.md
§7); bf16 is tested on the GPU (tests/test_triton_gpu.py).

The same child also checks the registered op ``torch.ops.mla_dispatch.triton_decode``
with ``torch.library.opcheck`` (``OPCHECK_CASES``). Under the interpreter the op is
an opaque custom op (``kernels/triton/ops.py`` says why); on the GPU it is a
``triton_op`` and tests/test_triton_gpu.py opchecks that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_V4 = dict(head_dim_qk=512, head_dim_v=512, kv_format="fp8_ds_v4")

# (id, make_case kwargs, make_state overrides)
CASES = [
    ("fp16-b3xs1xh4-ps16", dict(batch=3, q_len=1, num_heads_q=4, seqlen=40, page_size=16), {}),
    ("fp16-b2xs1xh4-hkv2-ps1", dict(batch=2, q_len=1, num_heads_q=4, num_heads_kv=2, seqlen=24, page_size=1), {}),
    ("fp16-b3xs3xh2-ps7-causal-zero", dict(batch=3, q_len=3, num_heads_q=2, seqlen=40, page_size=7, causal=True,
                                           zero_len_rows=1), {}),
    ("fp16-b2xs2xh2-ps256", dict(batch=2, q_len=2, num_heads_q=2, seqlen=50, page_size=256), {}),
    ("fp16-b2xs1xh3-ps16-d512", dict(batch=2, q_len=1, num_heads_q=3, seqlen=30, page_size=16, head_dim_qk=512), {}),
    ("fp16-b2xs1xh2-ps16-d320v256", dict(batch=2, q_len=1, num_heads_q=2, seqlen=30, page_size=16, head_dim_qk=320,
                                         head_dim_v=256), {}),
    ("fp16-b2xs2xh2-ps16-d192v128-causal", dict(batch=2, q_len=2, num_heads_q=2, seqlen=30, page_size=16,
                                                head_dim_qk=192, head_dim_v=128, causal=True), {}),
    ("fp8e4m3-b2xs1xh2-ps16", dict(batch=2, q_len=1, num_heads_q=2, seqlen=30, page_size=16, kv_format="fp8_e4m3"),
     {}),
    ("fp8dsmla-b2xs1xh2-ps16", dict(batch=2, q_len=1, num_heads_q=2, seqlen=30, page_size=16,
                                    kv_format="fp8_ds_mla"), {}),
    ("fp16-sparse-b2xs2xh2-topk20", dict(batch=2, q_len=2, num_heads_q=2, seqlen=30, page_size=16, topk=20), {}),
    # forced splits use fixed lengths so that the schedule surely splits (asserted below)
    ("fp16-split-b3xs2xh17-ps16-causal", dict(batch=3, q_len=2, num_heads_q=17, seqlen=70, page_size=16,
                                             causal=True, zero_len_rows=1, varlen=False), dict(num_parts=9, overhead=1)),
    ("fp8dsmla-split-b2xs1xh2-ps8", dict(batch=2, q_len=1, num_heads_q=2, seqlen=60, page_size=8,
                                         kv_format="fp8_ds_mla", varlen=False), dict(num_parts=5, overhead=1)),
    # more requests than part boundaries: the combine's grid runs over the boundaries (combine_by_boundary)
    ("fp16-split-boundary-b7xs1xh4-ps16", dict(batch=7, q_len=1, num_heads_q=4, seqlen=70, page_size=16, varlen=False),
     dict(num_parts=4, overhead=1, by_boundary=True)),
    # more slots per request than the combine reads per loop trip (its block of 8)
    ("fp16-split-many-b2xs1xh4-ps16", dict(batch=2, q_len=1, num_heads_q=4, seqlen=300, page_size=16, varlen=False),
     dict(num_parts=24, overhead=1, min_splits=9)),
    # the register-saving variants: V split over programs, chunked latent dot, tokens on M
    ("fp16-vsplit2-qk128-b2xs2xh3-ps16-causal", dict(batch=2, q_len=2, num_heads_q=3, seqlen=40, page_size=16,
                                                     causal=True),
     dict(config=dict(block_m=16, block_n=16, num_warps=4, num_stages=1, v_split=2, qk_chunk=128, chunk_size=16))),
    ("fp8dsmla-vsplit2-qk128-b2xs1xh2-ps16", dict(batch=2, q_len=1, num_heads_q=2, seqlen=40, page_size=16,
                                                  kv_format="fp8_ds_mla"),
     dict(config=dict(block_m=16, block_n=16, num_warps=4, num_stages=1, v_split=2, qk_chunk=128, chunk_size=16))),
    ("fp16-tokensM-vsplit4-b2xs1xh4-ps16", dict(batch=2, q_len=1, num_heads_q=4, seqlen=40, page_size=16,
                                                kv_format="fp8_e4m3", varlen=False),
     dict(config=dict(block_m=16, block_n=16, num_warps=4, num_stages=1, v_split=4, qk_chunk=256,
                      tokens_on_m=True, chunk_size=16), num_parts=4, overhead=1)),
    # whole tiles by TMA (tensor descriptors), the partial last tile by the masked gather: varlen lengths put a
    # partial tile (and NaN-poisoned slots past the end in its page) in most requests
    ("fp16-tma-b3xs2xh3-ps32-causal-zero", dict(batch=3, q_len=2, num_heads_q=3, seqlen=70, page_size=32,
                                               causal=True, zero_len_rows=1),
     dict(config=dict(block_m=16, block_n=16, num_warps=4, num_stages=2, tma=True, chunk_size=16))),
    ("fp16-tma-tokensM-split-b2xs1xh4-ps16", dict(batch=2, q_len=1, num_heads_q=4, seqlen=75, page_size=16,
                                                  varlen=False),
     dict(config=dict(block_m=16, block_n=16, num_warps=4, num_stages=2, tma=True, tokens_on_m=True, chunk_size=16),
          num_parts=5, overhead=1)),
    ("fp16-tma-d512-b2xs1xh2-ps16", dict(batch=2, q_len=1, num_heads_q=2, seqlen=40, page_size=16, head_dim_qk=512),
     dict(config=dict(block_m=16, block_n=16, num_warps=4, num_stages=2, tma=True, chunk_size=16))),
    # DeepSeek-V4 (fp8_ds_v4, FlashMLA's MODEL1) with FlashMLA's optional sparse arguments: topk_length, a sink, an
    # extra cache on pages of 2 with its own length; then split so that items straddle the two lists (40 is no
    # multiple of the 16-token chunk) and the combine applies the sink; then the chunked dot / V split, whose column
    # groups straddle the fp8 / bf16 boundary at channel 448
    ("fp8dsv4-sparse-extras-b3xs2xh3-ps61", dict(batch=3, q_len=2, num_heads_q=3, seqlen=90, page_size=61, topk=40,
                                                 topk_length=True, attn_sink=True, extra_topk=24, extra_page_size=2,
                                                 extra_topk_length=True, zero_len_rows=1, **_V4), {}),
    ("fp8dsv4-split-extras-b2xs1xh4-ps16", dict(batch=2, q_len=1, num_heads_q=4, seqlen=90, page_size=16, topk=40,
                                                attn_sink=True, extra_topk=24, extra_page_size=5, **_V4),
     dict(num_parts=5, overhead=1)),
    ("fp8dsv4-vsplit2-qk128-b2xs1xh2-ps16", dict(batch=2, q_len=1, num_heads_q=2, seqlen=40, page_size=16, topk=24,
                                                 attn_sink=True, **_V4),
     dict(config=dict(block_m=16, block_n=16, num_warps=4, num_stages=1, v_split=2, qk_chunk=128, chunk_size=16))),
    ("fp16-sparse-extras-hkv2-b2xs2xh4-ps16", dict(batch=2, q_len=2, num_heads_q=4, num_heads_kv=2, seqlen=40,
                                                   page_size=16, topk=20, topk_length=True, attn_sink=True,
                                                   extra_topk=12, extra_page_size=3, head_dim_qk=192, head_dim_v=128),
     dict(num_parts=3, overhead=1)),
]


# (id, make_case kwargs, make_state overrides): small cases for torch.library.opcheck; each runs the op
# several times (schema, fake tensor, autograd registration, AOT dispatch static and dynamic)
OPCHECK_CASES = [
    ("opcheck-fp16-split-b2xs2xh3-ps16-causal", dict(batch=2, q_len=2, num_heads_q=3, seqlen=40, page_size=16,
                                                    causal=True, varlen=False), dict(num_parts=5, overhead=1)),
    ("opcheck-fp16-sparse-b2xs2xh2-topk20", dict(batch=2, q_len=2, num_heads_q=2, seqlen=30, page_size=16, topk=20),
     {}),
    ("opcheck-fp8dsmla-b2xs1xh2-ps16", dict(batch=2, q_len=1, num_heads_q=2, seqlen=30, page_size=16,
                                            kv_format="fp8_ds_mla"), {}),
    ("opcheck-fp8dsv4-extras-b2xs1xh2-ps16", dict(batch=2, q_len=1, num_heads_q=2, seqlen=30, page_size=16, topk=16,
                                                  topk_length=True, attn_sink=True, extra_topk=8, extra_page_size=4,
                                                  **_V4), {}),
]

TRITON_DECODE_SCHEMA = (
    "mla_dispatch::triton_decode(Tensor q, Tensor kv_cache, Tensor? block_table, Tensor seqlens, Tensor? indices, "
    "Tensor? kv_scale, Tensor items, Tensor part_offsets, Tensor num_splits, Tensor first_slot, Tensor(a10!) out, "
    "Tensor(a11!) lse, Tensor(a12!) partial_out, Tensor(a13!) partial_lse, float softmax_scale, bool causal, "
    "str kv_format, SymInt block_m, SymInt block_n, SymInt num_warps, SymInt num_stages, bool tokens_on_m, "
    "SymInt v_split, SymInt qk_chunk, SymInt max_registers, bool tma, bool gluon, bool fixed_splits=False, "
    "Tensor? topk_length=None, Tensor? attn_sink=None, Tensor? extra_kv_cache=None, Tensor? extra_indices=None, "
    "Tensor? extra_topk_length=None) -> ()"
)


def triton_op_args(plan, case, out, lse) -> tuple:
    """The arguments of ``torch.ops.mla_dispatch.triton_decode`` for a Triton ``plan`` of ``case``
    (the order ``TritonBackend.run`` passes them in)."""
    p, st = plan.problem, plan.state
    s, cfg = st.schedule, st.cfg
    return (case.q, case.kv_cache, None if p.sparse else case.block_table, st.lengths, case.indices, case.kv_scale,
            s.items, s.part_offsets, s.num_splits, st.first_slot, out, lse, st.partial_out, st.partial_lse,
            plan.softmax_scale, p.causal, p.kv_format, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
            cfg.tokens_on_m, cfg.v_split, cfg.qk_chunk, cfg.max_registers, cfg.tma, cfg.gluon, s.fixed_splits,
            case.topk_length, case.attn_sink, case.extra_kv_cache, case.extra_indices, case.extra_topk_length)


def _run_op_checks(seed: int) -> None:
    """Child process: the op is registered with its schema, and opcheck passes (one JSON line each)."""
    import torch

    from mla_dispatch import plan_decode
    from mla_dispatch.numerics.oracle import reference_attention
    from mla_dispatch.backends.triton import TritonBackend
    from mla_dispatch.dispatch.platform import platform_for
    from mla_dispatch.numerics.cases import make_case
    from mla_dispatch.numerics.tolerance import compare_outputs

    for i, (cid, kw, overrides) in enumerate(OPCHECK_CASES):
        try:
            g = torch.Generator().manual_seed(seed + 1000 + i)
            case = make_case(dtype=torch.float16, generator=g, **kw)
            plan = plan_decode(*case.args(), backend="triton", **case.kwargs())
            if overrides:
                plan._state = TritonBackend.make_state(plan.problem, platform_for(case.q.device), plan.cache_seqlens,
                                                       **overrides)
                if not bool((plan.state.schedule.num_splits > 1).any()):
                    raise AssertionError("schedule did not split")
            if i == 0:
                op = torch.ops.mla_dispatch.triton_decode.default
                registered = plan.state.op is op and str(op._schema) == TRITON_DECODE_SCHEMA
                print(json.dumps({"id": "op-registered", "ok": registered, "message": str(op._schema)}), flush=True)
            b, s, h, _ = case.q.shape
            out = torch.full((b, s, h, case.head_dim_v), float("nan"), dtype=case.q.dtype)
            lse = torch.full((b, h, s), float("nan"))
            # every test_util, test_aot_dispatch_dynamic included: the interpreter's op is opaque to tracing
            args = triton_op_args(plan, case, out, lse)
            torch.library.opcheck(torch.ops.mla_dispatch.triton_decode.default, args)
            torch.ops.mla_dispatch.triton_decode(*args)  # opcheck ran on clones: out / lse are still NaN
            rep = compare_outputs(out, lse, *reference_attention(*case.args(), **case.kwargs()),
                                  TritonBackend.TOLERANCE)
            ok, msg = bool(rep), rep.message
        except Exception as exc:  # reported to the parent
            ok, msg = False, f"{type(exc).__name__}: {exc}"
        print(json.dumps({"id": cid, "ok": ok, "message": msg}), flush=True)


def _run_cases(seed: int) -> None:
    """Child process: run every case, print one JSON line each."""
    import torch

    from mla_dispatch import plan_decode
    from mla_dispatch.numerics.oracle import reference_attention
    from mla_dispatch.backends.triton import TritonBackend
    from mla_dispatch.dispatch.platform import platform_for
    from mla_dispatch.numerics.cases import make_case
    from mla_dispatch.numerics.tolerance import compare_outputs

    for i, (cid, kw, overrides) in enumerate(CASES):
        try:
            g = torch.Generator().manual_seed(seed + i)
            case = make_case(dtype=torch.float16, generator=g, **kw)
            plan = plan_decode(*case.args(), backend="triton", **case.kwargs())
            split = False
            wants_split = "num_parts" in overrides
            if overrides:
                from mla_dispatch.kernels.triton.decode import KernelConfig

                ov = dict(overrides)
                min_splits = ov.pop("min_splits", 2)
                by_boundary = ov.pop("by_boundary", False)
                if "config" in ov:
                    ov["config"] = KernelConfig(**ov["config"])
                # swap in a schedule that forces split requests (exercises the combine) or another config, with
                # the plan's eager launch bound (the path DecodePlan.run takes)
                plan._state = TritonBackend.make_state(plan.problem, platform_for(case.q.device), plan.cache_seqlens,
                                                       block_table=plan.block_table, softmax_scale=plan.softmax_scale,
                                                       **ov)
                split = int(plan.state.schedule.num_splits.max()) >= min_splits
                # the case exists for the TMA path: the plan's launch must take it
                if ov.get("config") is not None and ov["config"].tma and plan.state.launch.kernel != "tma":
                    raise AssertionError(f"the plan's launch is {plan.state.launch}, not the TMA path")
                if by_boundary:  # the case exists for the combine's per-boundary grid: it must take it
                    from mla_dispatch.kernels.triton.combine import combine_by_boundary

                    split = split and combine_by_boundary(kw["batch"], plan.state.schedule.num_parts)
            b, s, h, _ = case.q.shape
            out = torch.full((b, s, h, case.head_dim_v), float("nan"), dtype=case.q.dtype)
            lse = torch.full((b, h, s), float("nan"))
            plan.run(case.q, case.kv_cache, kv_scale=case.kv_scale, indices=case.indices, out=out, lse=lse,
                     **case.sparse_extras())
            if plan.state.prepared.kind != plan.state.launch.kernel:
                raise AssertionError(f"ran {plan.state.prepared.kind}, the plan froze {plan.state.launch}")
            ref_out, ref_lse = reference_attention(*case.args(), **case.kwargs())
            rep = compare_outputs(out, lse, ref_out, ref_lse, TritonBackend.TOLERANCE)
            ok = bool(rep) and (split or not wants_split)
            msg = rep.message + ("" if split or not wants_split else " (schedule did not split)")
        except Exception as exc:  # reported to the parent
            ok, msg = False, f"{type(exc).__name__}: {exc}"
        print(json.dumps({"id": cid, "ok": ok, "message": msg}), flush=True)


@pytest.fixture(scope="module")
def interpreter_results(request) -> dict:
    from tests.conftest import interpreter_child_results

    return interpreter_child_results(__file__)


@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_triton_interpreter_matches_reference(interpreter_results, case_id):
    rec = interpreter_results.get(case_id)
    assert rec is not None, f"case {case_id} did not report (child crashed?)"
    assert rec["ok"], rec["message"]


def test_triton_op_registered_under_interpreter(interpreter_results):
    """Planning registers torch.ops.mla_dispatch.triton_decode with the schema TRITON_DECODE_SCHEMA."""
    rec = interpreter_results.get("op-registered")
    assert rec is not None, "op registration did not report (child crashed?)"
    assert rec["ok"], f"plan.state.op is not the op, or its schema changed: {rec['message']}"


@pytest.mark.parametrize("case_id", [c[0] for c in OPCHECK_CASES])
def test_triton_opcheck_under_interpreter(interpreter_results, case_id):
    rec = interpreter_results.get(case_id)
    assert rec is not None, f"case {case_id} did not report (child crashed?)"
    assert rec["ok"], rec["message"]


def test_triton_not_runnable_on_cpu_without_interpreter():
    """Without TRITON_INTERPRET the backend says why it cannot run on a CPU, and 'auto' never picks it."""
    pytest.importorskip("triton")
    code = (
        "import os, torch\n"
        "os.environ.pop('TRITON_INTERPRET', None)\n"
        "from mla_dispatch.dispatch.registry import get_backend\n"
        "from mla_dispatch.dispatch.platform import platform_for\n"
        "from mla_dispatch.dispatch.problem import describe_inputs\n"
        "from mla_dispatch.dispatch.select import priority\n"
        "from mla_dispatch.numerics.cases import make_case\n"
        "c = make_case(1, 1, 2, 8, page_size=4, dtype=torch.float16)\n"
        "p = describe_inputs(*c.args(), head_dim_v=512, causal=False, kv_format='auto', kv_scale=None, indices=None,"
        " return_lse=True)\n"
        "plat = platform_for(c.q.device)\n"
        "print([r.message for r in get_backend('triton').not_supported_reasons(p, plat)])\n"
        "print('triton' in priority(p, plat))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reasons, in_priority = proc.stdout.strip().splitlines()[-2:]
    assert "TRITON_INTERPRET=1" in reasons
    assert in_priority == "False"


def test_import_mla_dispatch_does_not_import_triton():
    code = "import sys, mla_dispatch, mla_dispatch.backends.triton; print('triton' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


if __name__ == "__main__":
    _seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    _run_cases(_seed)
    _run_op_checks(_seed)


def test_tma_applies_only_where_the_descriptors_are_valid():
    """The TMA path's gate (decode.tma_applies) and the table's use of it (decode.choose_config): taken for a
    contiguous bf16/fp16 cache with one KV head and pages of whole tiles, refused for every other case."""
    pytest.importorskip("triton")
    import torch

    from mla_dispatch.kernels.triton.decode import GLUON_CONFIG, TMA_CONFIGS, choose_config, tma_applies

    def gate(kv, **kw):
        args = dict(kv_format="bf16", sparse=False, block_n=64, v_split=1, qk_chunk=512, head_dim_v=512, traced=False)
        args.update(kw)
        return tma_applies(True, kv, **args)

    kv = torch.zeros(3, 64, 1, 576, dtype=torch.bfloat16)
    assert gate(kv)
    assert gate(torch.zeros(3, 128, 1, 576, dtype=torch.float16), kv_format="fp16")
    assert not tma_applies(False, kv, kv_format="bf16", sparse=False, block_n=64, v_split=1, qk_chunk=512,
                           head_dim_v=512, traced=False)
    assert not gate(kv, traced=True)  # a wrap_triton launch (torch.compile / export)
    assert not gate(kv, sparse=True)
    assert not gate(kv, kv_format="fp8_e4m3")
    assert not gate(kv, kv_format="fp8_ds_mla")
    assert not gate(kv, v_split=2)
    assert not gate(kv, qk_chunk=256)
    assert not gate(torch.zeros(3, 32, 1, 576, dtype=torch.bfloat16))  # a page holds half a tile
    assert not gate(torch.zeros(3, 64, 2, 576, dtype=torch.bfloat16))  # two KV heads
    assert not gate(torch.zeros(3, 64, 1, 600, dtype=torch.bfloat16)[..., :576])  # rows not contiguous
    assert not gate(torch.zeros(3 * 64 * 576 + 1, dtype=torch.bfloat16)[1:].view(3, 64, 1, 576))  # base misaligned

    for rows in (16, 32, 64, 128):
        cfg = choose_config(rows, "bf16", page_size=64)
        assert cfg is TMA_CONFIGS[(rows, "bf16")] and cfg.tma
        assert not choose_config(rows, "bf16", page_size=16).tma  # pages shorter than the tile
        assert not choose_config(rows, "bf16", page_size=64, heads_kv=2).tma
        assert not choose_config(rows, "fp8_e4m3", page_size=64).tma
        assert not choose_config(rows, "bf16").tma  # sparse / unknown page size
        # the Gluon sm_90 kernel's config, where the caller says it can run: bf16 / fp16 caches with one KV head
        assert choose_config(rows, "bf16", page_size=128, gluon=True) is GLUON_CONFIG and GLUON_CONFIG.gluon
        assert choose_config(rows, "fp16", page_size=64, gluon=True) is GLUON_CONFIG
        assert not choose_config(rows, "bf16", page_size=64).gluon
        for page_size in (1, 16, 33, 96):  # shorter or unaligned pages: the Gluon kernel gathers every tile
            assert choose_config(rows, "bf16", page_size=page_size, gluon=True) is GLUON_CONFIG
        assert not choose_config(rows, "bf16", page_size=64, heads_kv=2, gluon=True).gluon
        # fp8_e4m3 at every row count: up to 32 rows the tokens-on-M kernel (gluon_fp8.py), from 32 the Gluon sm_90 one
        assert choose_config(rows, "fp8_e4m3", page_size=16, gluon=True) is GLUON_CONFIG
        assert not choose_config(rows, "fp8_ds_mla", page_size=64, gluon=True).gluon
        assert not choose_config(rows, "bf16", gluon=True).gluon
    # without the tokens-on-M kernel (fp8t=False: a plan with backend_options={"kernel": "gluon"}) from 32 rows only:
    # gluon_sm90 converts in shared memory and is slower than the plain kernel's 16-row config at 16 rows
    for rows in (16, 32, 64, 128):
        assert (choose_config(rows, "fp8_e4m3", page_size=16, gluon=True, fp8t=False) is GLUON_CONFIG) == (rows >= 32)


def test_gluon_kernel_gate():
    """Where the Gluon sm_90 kernel may run (gluon_sm90.gluon_possible at planning, gluon_applies at launch): only on
    compute capability 9.0, dense, D_qk 576 / D_v 512; never on CPU tensors (the interpreter runs the plain kernel)."""
    pytest.importorskip("triton")
    import torch

    from mla_dispatch.kernels.triton.gluon_sm90 import GLUON_API, gluon_applies, gluon_possible

    ok = dict(capability=(9, 0), sparse=False, head_dim_qk=576, head_dim_v=512)
    assert gluon_possible(**ok) == GLUON_API
    for bad in (dict(capability=(10, 0)), dict(capability=(8, 0)), dict(capability=None), dict(sparse=True),
                dict(head_dim_qk=512), dict(head_dim_v=256)):
        assert not gluon_possible(**dict(ok, **bad)), bad
    q = torch.zeros(2, 1, 64, 576, dtype=torch.bfloat16)
    kv = torch.zeros(3, 64, 1, 576, dtype=torch.bfloat16)
    assert not gluon_applies(q, kv, kv_format="bf16", sparse=False, head_dim_v=512, traced=False)


def test_a_forced_kernel_that_cannot_run_the_problem_is_refused_with_its_reasons():
    """backend_options={"kernel": ...} naming a kernel that cannot run the problem: OptionNotSupported (a ValueError,
    which bench reports as unsupported) with what the kernel needs; the plan's own choice runs."""
    pytest.importorskip("triton")
    import torch

    from mla_dispatch.backends.triton import _shape_plan
    from mla_dispatch.dispatch.backend import OptionNotSupported
    from mla_dispatch.dispatch.platform import Platform
    from mla_dispatch.dispatch.problem import DecodeProblem

    h100 = Platform("cuda", "NVIDIA H100 80GB HBM3", (9, 0), "sm_90", 132)
    p = DecodeProblem(batch=4, q_len=1, num_heads_q=16, num_heads_kv=1, head_dim_qk=576, head_dim_v=512, page_size=64,
                      max_blocks=8, q_dtype=torch.bfloat16, kv_format="bf16", causal=False, topk=0, return_lse=True,
                      device_type="cuda")
    with pytest.raises(OptionNotSupported, match=r"backend_options\['kernel'\]='fp8t' cannot run this problem: it "
                                                 r"needs .*kv_format='bf16' \(supported: fp8_e4m3\)"):
        _shape_plan(p, h100, None, "fp8t", None, None, None)
    launch, _ = _shape_plan(p, h100, None, None, None, None, None)
    assert launch is not None
