"""The reference backend against an independent float64 computation (tests/oracle64.py: Python loops over
requests, query tokens and heads, tokens gathered one by one and decoded with its own code)."""

import dataclasses
import random

import pytest
import torch

import mla_dispatch
from mla_dispatch.numerics.oracle import reference_attention
from mla_dispatch.numerics.cases import make_case
from mla_dispatch.numerics.tolerance import check_close, compare_outputs
from oracle64 import naive_attention


def _cases():
    rng = random.Random(1234)  # the case *shapes* are fixed; the data are fresh each run (gen fixture)
    cases = []
    for page_size in (1, 16, 64, 128):
        for kv_format in ("bf16", "fp16", "fp8_e4m3", "fp8_ds_mla"):
            h_kv = 1 if kv_format == "fp8_ds_mla" else rng.choice((1, 2))
            h_q = rng.choice([h for h in (1, 3, 16, 64, 128) if h % h_kv == 0])
            q_len = rng.choice((1, 2, 4))
            causal = rng.random() < 0.6
            sparse = kv_format in ("bf16", "fp8_ds_mla") and page_size in (16, 64) and not causal
            cases.append((page_size, kv_format, h_q, h_kv, q_len, causal, sparse))
    return cases


@pytest.mark.parametrize(
    "page_size,kv_format,h_q,h_kv,q_len,causal,sparse",
    _cases(),
    ids=lambda v: str(v),
)
def test_reference_matches_float64(page_size, kv_format, h_q, h_kv, q_len, causal, sparse, gen):
    dtype = torch.float16 if kv_format == "fp16" else torch.bfloat16
    head_dim_v = 512 if kv_format == "fp8_ds_mla" else 64
    head_dim_qk = 576 if kv_format == "fp8_ds_mla" else 96
    case = make_case(3, q_len, h_q, 40, num_heads_kv=h_kv, head_dim_qk=head_dim_qk, head_dim_v=head_dim_v,
                     page_size=page_size, dtype=dtype, kv_format=kv_format, causal=causal, zero_len_rows=1,
                     topk=24 if sparse else 0, generator=gen)
    out, lse = reference_attention(*case.args(), **case.kwargs())
    want_out, want_lse = naive_attention(case, head_dim_v)
    assert check_close("out", out, want_out, 1e-5, 1e-4)
    assert check_close("lse", lse, want_lse, 1e-5, 1e-5)
    # Zero-length requests: out = 0, lse = +inf (the last request is empty).
    assert torch.all(out[-1] == 0) and torch.all(torch.isposinf(lse[-1]))
    assert not torch.isnan(out).any()


def test_mla_decode_output_dtype_and_layout(gen):
    case = make_case(2, 2, 8, 50, page_size=16, causal=True, generator=gen, head_dim_qk=64, head_dim_v=32)
    poison = torch.full((2, 2, 8, 32), float("nan"), dtype=torch.bfloat16)
    out, lse = mla_dispatch.mla_decode(*case.args(), **case.kwargs(), out=poison)
    assert out is poison and out.dtype == torch.bfloat16 and out.shape == (2, 2, 8, 32)
    assert lse.dtype == torch.float32 and lse.shape == (2, 8, 2)
    report = compare_outputs(out, lse, *naive_attention(case), mla_dispatch.Tolerance())
    assert report, report.message


def test_causal_cut_rows_see_nothing(gen):
    # L=2, s_q=4, causal: query token i sees keys 0..L-s_q+i, so tokens 0 and 1 see nothing.
    case = make_case(1, 4, 2, 2, page_size=4, varlen=False, causal=True, generator=gen, head_dim_qk=32, head_dim_v=16)
    out, lse = reference_attention(*case.args(), **case.kwargs())
    assert torch.all(torch.isposinf(lse[0, :, :2])) and torch.all(torch.isfinite(lse[0, :, 2:]))
    assert torch.all(out[0, :2] == 0)


def test_reference_op_registered_and_opcheck(gen):
    import mla_dispatch.backends.reference  # noqa: F401  (defines the op; alone, no other test has imported it yet)

    case = make_case(2, 1, 4, 20, page_size=8, generator=gen, head_dim_qk=32, head_dim_v=16)
    out = torch.full((2, 1, 4, 16), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((2, 4, 1), float("nan"))
    args = (case.q, case.kv_cache, case.block_table, case.cache_seqlens, None, None, out, lse,
            case.softmax_scale, False, "bf16")
    torch.library.opcheck(torch.ops.mla_dispatch.reference_decode.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    torch.ops.mla_dispatch.reference_decode(*args)
    report = compare_outputs(out, lse, *naive_attention(case), mla_dispatch.Tolerance())
    assert report, report.message


def test_scale_outputs_scales_the_outputs_not_the_scores(gen):
    """mla_dispatch.numerics.cases.scale_outputs (the output-range tests' setup): the reference's outputs grow by the scale,
    its LSE stays as drawn (up to q's bf16 rounding), the absolute bound grows alike; fp8 caches are refused."""
    from mla_dispatch.numerics.cases import case_reference, scale_outputs

    case = make_case(2, 1, 16, 300, page_size=64, generator=gen)
    out, lse = case_reference(case)
    # the scaled values are rounded to bf16 again (2^-8 relative each), and an output is a weighted mean of them:
    # its error is bounded by 2^-8 of the largest value, not of the output, which cancellation can make small
    # (a bound of 1e-4 alone failed ~1 seed in 150)
    vmax = case.kv_cache[..., : case.head_dim_v].float().nan_to_num(0.0).abs().max().item()
    tol = scale_outputs(case, 1e9, mla_dispatch.Tolerance())
    big_out, big_lse = case_reference(case)
    assert tol.out_atol == mla_dispatch.Tolerance().out_atol * 1e9
    assert check_close("out", big_out / 1e9, out, max(1e-4, 2.01 / 256 * vmax), 2.01 / 128)
    assert check_close("lse", big_lse, lse, 1e-4, 0.0)
    with pytest.raises(ValueError, match="bf16/fp16 cache"):
        scale_outputs(make_case(1, 1, 16, 64, page_size=64, kv_format="fp8_e4m3", generator=gen), 2.0,
                      mla_dispatch.Tolerance())


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["grouped", "invariant"])
def test_reference_work_follows_the_tokens_not_the_tables_width(batch_invariant, gen, monkeypatch):
    """Two requests of 10 and 3 tokens in a 2,000-column table (page 16: 32,000 positions each) once gathered and
    decoded every position (a 20,000-column table at page 64 took 18-27 s and 9.2 GB). The oracle's one gather
    (gather_tokens) is wrapped to count what it decodes; the result is checked against tests/oracle64."""
    import mla_dispatch.numerics.oracle as oracle_mod

    decoded = []
    real = oracle_mod.gather_tokens

    def counting(kv_cache, blocks, offsets, *args, **kwargs):
        decoded.append(torch.broadcast_shapes(blocks.shape, offsets.shape).numel())
        return real(kv_cache, blocks, offsets, *args, **kwargs)

    monkeypatch.setattr(oracle_mod, "gather_tokens", counting)
    case = make_case(2, 2, 4, 10, page_size=16, causal=True, generator=gen, varlen=False)
    case.cache_seqlens[1] = 3
    wide = torch.full((2, 2000), 7, dtype=torch.int32)  # every entry a valid block: only the lengths bound the work
    wide[:, : case.block_table.shape[1]] = case.block_table
    case = dataclasses.replace(case, block_table=wide)
    out, lse = reference_attention(*case.args(), **case.kwargs(), batch_invariant=batch_invariant)
    report = compare_outputs(out, lse, *naive_attention(case), mla_dispatch.Tolerance())
    assert report, report.message
    bound = 2 * 256 if batch_invariant else 2 * 10  # one fixed chunk per request / the longest request per request
    assert sum(decoded) <= bound, f"decoded {sum(decoded)} token slots for 13 tokens"
