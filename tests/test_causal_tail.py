"""A key the causal mask hides from a query never reaches that query's result, whatever it holds.

With s_q > 1, query token i sees keys ``0 .. L - s_q + i``: the last ``s_q - 1`` keys of a request (the draft
tokens of a speculative step) are seen by the later queries only. A NaN in one of them once made the earlier
queries' ``out`` NaN (their lse stayed finite): they give the key p = 0, but ``0 * NaN`` in ``P V`` is NaN. The
float64 oracle (tests/oracle64.py) reads only the keys each query sees, so it gives NaN exactly for the rows that
see a NaN key, and compare_outputs checks the NaN positions match.

The reference runs here; the Triton kernel under the interpreter in a child process (``python
tests/test_causal_tail.py SEED``, one JSON line per case: TRITON_INTERPRET=1 must be set before triton is
imported), fp16 (the interpreter's bf16 dot is wrong); the GPU backends on the device (``gpu``).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

# (id, make_case kwargs, plan_decode kwargs)
CASES = [
    ("b3xs3xh4-ps16", dict(batch=3, q_len=3, num_heads_q=4, seqlen=40, page_size=16), {}),
    ("b2xs2xh8-ps1", dict(batch=2, q_len=2, num_heads_q=8, seqlen=30, page_size=1), {}),
    ("b2xs4xh2-ps64-hkv2", dict(batch=2, q_len=4, num_heads_q=4, num_heads_kv=2, seqlen=70, page_size=64), {}),
    ("b3xs3xh4-ps16-invariant", dict(batch=3, q_len=3, num_heads_q=4, seqlen=300, page_size=16),
     dict(batch_invariant=True)),
]
# Triton only: its other kernel paths, forced (make_state overrides, as tests/test_triton_interpret.py does):
# tokens on M, whole tiles by TMA, a schedule that splits requests (the tail in the last piece).
TRITON_CASES = [
    ("triton-tokensM", dict(batch=2, q_len=3, num_heads_q=4, seqlen=40, page_size=16, varlen=False),
     dict(config=dict(block_m=16, block_n=16, num_warps=4, num_stages=1, tokens_on_m=True, chunk_size=16))),
    ("triton-tma", dict(batch=2, q_len=2, num_heads_q=3, seqlen=64, page_size=32, varlen=False),
     dict(config=dict(block_m=16, block_n=16, num_warps=4, num_stages=2, tma=True, chunk_size=16))),
    ("triton-split", dict(batch=2, q_len=3, num_heads_q=4, seqlen=70, page_size=16, varlen=False),
     dict(num_parts=5, overhead=1)),
]


def poison_the_tail(case, gen) -> dict:
    """NaN in one channel of one of each request's last s_q - 1 keys (at random): the queries before it must not
    see it. Returns {request: the token poisoned}."""
    kv = case.kv_cache if case.kv_cache.dim() == 4 else case.kv_cache.unsqueeze(2)
    ps, s_q = kv.shape[1], case.q.shape[1]
    poisoned = {}
    for b, length in enumerate(case.cache_seqlens.tolist()):
        if length < s_q:
            continue
        t = length - 1 - int(torch.randint(0, s_q - 1, (1,), generator=gen))
        block = int(case.block_table[b, t // ps])
        channel = int(torch.randint(0, case.head_dim_v, (1,), generator=gen))  # a V channel: part of K too
        kv[block, t % ps, int(torch.randint(0, kv.shape[2], (1,), generator=gen)), channel] = float("nan")
        poisoned[b] = t
    return poisoned


def check_case(case_id, make_kw, plan_kw, *, dtype, backend, device, seed) -> tuple[bool, str]:
    """Run one case on ``backend``; (ok, message)."""
    from mla_dispatch import get_backend, plan_decode
    from mla_dispatch.numerics.cases import make_case
    from mla_dispatch.numerics.tolerance import compare_outputs
    from oracle64 import naive_attention

    gen = torch.Generator().manual_seed(seed)
    case = make_case(dtype=dtype, causal=True, generator=gen, **make_kw)
    poisoned = poison_the_tail(case, gen)
    if not poisoned:
        return False, "no request was poisoned"
    want_out, want_lse = naive_attention(case)
    on = dataclasses.replace(case, **{f: getattr(case, f).to(device) for f in ("q", "kv_cache", "block_table",
                                                                               "cache_seqlens", "kv_scale")
                                      if getattr(case, f) is not None})
    state_kw = {k: plan_kw[k] for k in ("config", "num_parts", "overhead") if k in plan_kw}
    plan = plan_decode(*on.args(), **on.kwargs(), backend=backend,
                       **{k: v for k, v in plan_kw.items() if k not in state_kw})
    if state_kw:  # another Triton kernel path for the same problem
        from mla_dispatch.backends.triton import TritonBackend
        from mla_dispatch.dispatch.platform import platform_for
        from mla_dispatch.kernels.triton.decode import KernelConfig

        if "config" in state_kw:
            state_kw["config"] = KernelConfig(**state_kw["config"])
        plan._state = TritonBackend.make_state(plan.problem, platform_for(on.q.device), plan.cache_seqlens, **state_kw)
    b, s, h, _ = case.q.shape
    out = torch.full((b, s, h, case.head_dim_v), float("nan"), dtype=case.q.dtype, device=device)
    lse = torch.full((b, h, s), float("nan"), device=device)
    plan.run(on.q, on.kv_cache, kv_scale=on.kv_scale, out=out, lse=lse)
    out, lse = out.cpu(), lse.cpu()
    first = out[:, 0]
    if not torch.isfinite(first[list(poisoned)]).all():
        return False, f"query 0 sees a NaN it must not (out NaN for requests {list(poisoned)})"
    rep = compare_outputs(out, lse, want_out, want_lse, get_backend(backend).TOLERANCE)
    return bool(rep), rep.message


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reference_keeps_hidden_keys_out(case, seed):
    ok, msg = check_case(*case, dtype=torch.bfloat16, backend="reference", device="cpu", seed=seed)
    assert ok, msg


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    from tests.conftest import interpreter_child_results

    return interpreter_child_results(__file__)


@pytest.mark.parametrize("case_id", [c[0] for c in CASES + TRITON_CASES])
def test_triton_interpreter_keeps_hidden_keys_out(interpreter_results, case_id):
    rec = interpreter_results.get(case_id)
    assert rec is not None, f"case {case_id} did not report (child crashed?)"
    assert rec["ok"], rec["message"]


#: Every mainloop of cuda_sm90 forced on a causal tail (backend_options["variant"]): 16 query rows per KV head on pages
#: of 64, so each variant can run it: v2 (wgmma), v5 (seesaw, 16-bit caches), v6 (etap), v7 / v8 (fp8t, fp8_e4m3)
#: and v9 (seesaw_fp8). (id, make_case kwargs, plan_decode kwargs)
CUDA_SM90_VARIANT_CASES = [
    (f"v{v}-{fmt}", dict(batch=3, q_len=2, num_heads_q=8, seqlen=300, page_size=64, kv_format=fmt),
     dict(backend_options={"variant": v}))
    for fmt, variants in (("bf16", (2, 5, 6)), ("fp8_e4m3", (2, 6, 7, 8, 9))) for v in variants
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["triton", "cuda_sm90"])
@pytest.mark.parametrize("case", CASES + [
    ("b4xs2xh128-ps64", dict(batch=4, q_len=2, num_heads_q=128, seqlen=2000, page_size=64), {}),
    ("b4xs4xh16-ps64", dict(batch=4, q_len=4, num_heads_q=16, seqlen=700, page_size=64), {}),
], ids=lambda c: c[0])
def test_gpu_backends_keep_hidden_keys_out(case, backend, dtype, seed):
    from mla_dispatch import NoBackendError

    try:
        ok, msg = check_case(*case, dtype=dtype, backend=backend, device="cuda", seed=seed)
    except NoBackendError as exc:
        pytest.skip(str(exc)[:300])
    assert ok, msg


@pytest.mark.gpu
@pytest.mark.parametrize("case", CUDA_SM90_VARIANT_CASES, ids=[c[0] for c in CUDA_SM90_VARIANT_CASES])
def test_every_cuda_sm90_mainloop_keeps_hidden_keys_out(case, seed):
    """Each mainloop cleans the hidden keys' V on its own tail path: forced, not left to the plan's choice."""
    case_id, make_kw, plan_kw = case
    make_kw = dict(make_kw)
    if make_kw["kv_format"] == "bf16":
        del make_kw["kv_format"]
    ok, msg = check_case(case_id, make_kw, plan_kw, dtype=torch.bfloat16, backend="cuda_sm90", device="cuda",
                         seed=seed)
    assert ok, msg


def _run_interpreted(seed: int) -> None:
    """Child process (TRITON_INTERPRET=1): every case on triton, one JSON line each."""
    for i, (cid, make_kw, plan_kw) in enumerate(CASES + TRITON_CASES):
        try:
            ok, msg = check_case(cid, make_kw, plan_kw, dtype=torch.float16, backend="triton", device="cpu",
                                 seed=seed + i)
        except Exception as exc:  # reported to the parent
            ok, msg = False, f"{type(exc).__name__}: {exc}"
        print(json.dumps({"id": cid, "ok": ok, "message": msg}), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__file__))  # oracle64
    _run_interpreted(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
