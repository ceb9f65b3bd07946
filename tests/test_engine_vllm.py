"""mla_dispatch inside a real vLLM: our backend built and run through vLLM's own classes.

Skipped, with the reason, where vLLM does not import. Where it does, nothing of vLLM is imitated: the
``VllmConfig`` (a small DeepSeek-V2-shaped model config written to a temporary folder), vLLM's process
groups (one rank, gloo; two spawned ranks for decode context parallelism, tests/vllm_dcp_ranks.py), ``MLAAttention`` (which constructs our impl), ``ColumnParallelLinear`` for
``kv_b_proj`` with its quant method's weight processing, ``get_kv_cache_spec``, our builder constructed the
way vLLM's runner constructs it, ``CommonAttentionMetadata`` -> ``builder.build`` and
``MLAAttention.forward_impl`` (absorbed decode through ``forward_mqa``, vLLM's own prefill for prefill
rows, the ``W_UV`` projection). Outputs are NaN-poisoned, inputs fresh random, and every row is checked
against a float64 reference: decode rows through ``tests/oracle64.naive_attention`` with the docs/design.md
§5 tolerances.

On a machine without a GPU vLLM must run on its CPU platform: set ``VLLM_TARGET_DEVICE=cpu`` (done here
before vLLM is imported when torch sees no GPU). vLLM's CPU platform picks its own MLA backend whatever
``--attention-backend`` says, so ``MLAAttention`` is handed our backend class (its ``attn_backend``
argument) after the plugin registered it; the GPU selection path is checked through vLLM's own
``validate_configuration``. The KV cache is written by the test: vLLM's cache writer
(``concat_and_cache_mla``) is a CUDA op that this CPU process does not have.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket

import pytest
import torch

from mla_dispatch.numerics.cases import DecodeCase
from mla_dispatch.numerics.tolerance import compare_outputs
from oracle64 import naive_attention

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm==0.33.0): the engine tests cannot run here",
                allow_module_level=True)

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's platform is resolved on first use

try:
    from vllm.platforms import current_platform
    from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, SpeculativeConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  init_distributed_environment, initialize_model_parallel)
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
except Exception as exc:  # a broken install: say what failed
    pytest.skip(f"vLLM is installed but does not import here: {exc!r}", allow_module_level=True)

if not (current_platform.is_cpu() or current_platform.is_cuda()):
    pytest.skip(f"vLLM resolved no CPU or CUDA platform ({type(current_platform).__name__}); set "
                "VLLM_TARGET_DEVICE=cpu before vLLM is imported", allow_module_level=True)

import mla_dispatch  # noqa: E402
from mla_dispatch.integrations.plugins import VLLM_BACKEND_CLASS, register_vllm  # noqa: E402

TOL = mla_dispatch.get_backend("reference").TOLERANCE
HEADS, NOPE, ROPE, V_DIM, LORA = 16, 32, 64, 32, 512
SCALE = (NOPE + ROPE) ** -0.5
DEVICE = torch.device("cuda" if current_platform.is_cuda() else "cpu")

# A DeepSeek-V2-shaped text config (MLA with kv_lora_rank 512, rope 64), small everywhere else.
_MODEL_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 1,
    "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "kv_lora_rank": LORA, "q_lora_rank": None,
    "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": V_DIM, "n_routed_experts": 4,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "max_position_embeddings": 4096, "vocab_size": 1024, "torch_dtype": "bfloat16", "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv2_tiny")
    (path / "config.json").write_text(json.dumps(_MODEL_CONFIG))
    return str(path)


def _vllm_config(model_dir, block_size, cache_dtype, draft_tokens):
    model = ModelConfig(model=model_dir, dtype="bfloat16", max_model_len=1024, skip_tokenizer_init=True)
    spec = None
    if draft_tokens:  # makes MLA builders treat 1 + draft_tokens query tokens as decode (max_decode_query_len)
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=draft_tokens, prompt_lookup_max=3,
                                 prompt_lookup_min=1)
    return VllmConfig(model_config=model, cache_config=CacheConfig(block_size=block_size, cache_dtype=cache_dtype),
                      device_config=DeviceConfig(device=DEVICE.type), speculative_config=spec)


@pytest.fixture(scope="module")
def vllm_world(model_dir):
    """vLLM's process groups for one rank (gloo on 127.0.0.1), and our plugin registered."""
    with set_current_vllm_config(_vllm_config(model_dir, 16, "auto", 0)):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        initialize_model_parallel(1, 1)
    register_vllm()
    yield AttentionBackendEnum.CUSTOM.get_class()
    AttentionBackendEnum.CUSTOM.clear_override()
    destroy_model_parallel()
    destroy_distributed_environment()


class _Layer:
    """One vLLM MLA layer with our backend, its metadata builder and its config."""

    def __init__(self, backend_cls, model_dir, name, *, block_size, cache_dtype, draft_tokens, non_causal, gen):
        self.cfg = _vllm_config(model_dir, block_size, cache_dtype, draft_tokens)
        with set_current_vllm_config(self.cfg):
            kv_b_proj = ColumnParallelLinear(LORA, HEADS * (NOPE + V_DIM), bias=False, params_dtype=torch.bfloat16,
                                             prefix=f"{name}.kv_b_proj")
            self.layer = MLAAttention(num_heads=HEADS, scale=SCALE, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                                      v_head_dim=V_DIM, q_lora_rank=None, kv_lora_rank=LORA, kv_b_proj=kv_b_proj,
                                      cache_config=self.cfg.cache_config, prefix=f"{name}.attn",
                                      attn_backend=backend_cls, non_causal_multi_token_decode=non_causal)
            with torch.no_grad():
                kv_b_proj.weight.copy_((torch.randn(kv_b_proj.weight.shape, generator=gen) / 8).to(torch.bfloat16))
            kv_b_proj.quant_method.process_weights_after_loading(kv_b_proj)  # as vLLM's model loader does
            self.layer.process_weights_after_loading(torch.bfloat16)
            spec = self.layer.get_kv_cache_spec(self.cfg)
            self.builder = backend_cls.get_builder_cls()(spec, [f"{name}.attn"], self.cfg, DEVICE)
        self.kv_b_proj = kv_b_proj

    def build(self, meta):
        with set_current_vllm_config(self.cfg):
            return self.builder.build(0, meta)


def _batch(gen, decode_lens, s_q, prefills, block_size, causal=True):
    """A vLLM batch: decode requests first (s_q tokens each), then prefill requests (query, context).

    Returns the CommonAttentionMetadata, the per-request (seq_len, query_len) and the block table; block
    ids are a random permutation, unused table entries 0 (as vLLM's block table holds them).
    """
    reqs = [(n, s_q) for n in decode_lens] + [(q + c, q) for q, c in prefills]
    pages = [-(-n // block_size) for n, _ in reqs]
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(reqs), max(pages) + 1, dtype=torch.int32)
    for r, p in enumerate(pages):
        table[r, :p] = torch.tensor([perm.pop() for _ in range(p)], dtype=torch.int32)
    q_lens = torch.tensor([q for _, q in reqs], dtype=torch.int32)
    qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    qsl[1:] = q_lens.cumsum(0)
    seq = torch.tensor([n for n, _ in reqs], dtype=torch.int32)
    tokens = int(qsl[-1])
    meta = CommonAttentionMetadata(
        query_start_loc=qsl.to(DEVICE), query_start_loc_cpu=qsl, seq_lens=seq.to(DEVICE), num_reqs=len(reqs),
        num_actual_tokens=tokens, max_query_len=int(q_lens.max()), max_seq_len=int(seq.max()),
        block_table_tensor=table.to(DEVICE), slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=DEVICE),
        seq_lens_cpu_upper_bound=seq, causal=causal)
    return meta, reqs, table, num_blocks


def _fill_cache(gen, reqs, table, num_blocks, block_size, cache_dtype, k_scale):
    """Each request's latent tokens [seq_len, 576] (the values vLLM would have written) and the cache holding
    them: bf16, or float8_e4m3fn bytes of value / k_scale (vLLM's fp8 layout). Unused slots are NaN in a bf16
    cache (0x7f bytes, NaN, in an fp8 one)."""
    latents = [((torch.randn(n, LORA + ROPE, generator=gen) / 4).clamp(-1, 1)).to(torch.bfloat16) for n, _ in reqs]
    if cache_dtype == "auto":
        cache = torch.full((num_blocks, block_size, LORA + ROPE), float("nan"), dtype=torch.bfloat16)
    else:
        cache = torch.full((num_blocks, block_size, LORA + ROPE), 0x7F, dtype=torch.uint8)
    flat = cache.view(-1, LORA + ROPE)
    for r, (n, _) in enumerate(reqs):
        slots = torch.tensor([int(table[r, j // block_size]) * block_size + j % block_size for j in range(n)])
        if cache_dtype == "auto":
            flat[slots] = latents[r]
        else:
            flat[slots] = (latents[r].float() / k_scale).to(torch.float8_e4m3fn).view(torch.uint8)
    return latents, cache.to(DEVICE)


def _new_tokens(latents, reqs):
    """kv_c_normed [T, 512] and k_pe [T, 1, 64] of the batch's new tokens (the last query_len of each request)."""
    rows = torch.cat([lat[n - q:] for lat, (n, q) in zip(latents, reqs)])
    return rows[:, :LORA].contiguous(), rows[:, LORA:].unsqueeze(1).contiguous()


def _decode_case(query, cache, table, seq, cache_dtype, k_scale, causal, block_size):
    """Our canonical view of the decode requests, for the float64 oracle."""
    kv = cache.cpu()
    fmt = "bf16"
    if cache_dtype != "auto":
        kv, fmt = kv.view(torch.float8_e4m3fn), "fp8_e4m3"
    return DecodeCase(q=query, kv_cache=kv.view(kv.shape[0], block_size, 1, LORA + ROPE), block_table=table,
                      cache_seqlens=seq, kv_format=fmt, kv_scale=None if fmt == "bf16" else torch.tensor([k_scale]),
                      indices=None, causal=causal, head_dim_v=LORA, softmax_scale=SCALE)


def _prefill_reference(layer, q, latents, cache_rows, n, q_len):
    """float64 MHA of one prefill request as vLLM defines it: K/V up-projected from the latent (context from
    the cache, new tokens from kv_c_normed), causal over the new tokens. Returns [q_len, H * V]."""
    w = layer.kv_b_proj.weight.double().view(HEADS, NOPE + V_DIM, LORA)
    lat = torch.cat([cache_rows, latents[n - q_len:].double()])  # [n, 576]
    k_nope = torch.einsum("tl,hdl->thd", lat[:, :LORA], w[:, :NOPE])
    v = torch.einsum("tl,hdl->thd", lat[:, :LORA], w[:, NOPE:])
    k_pe = lat[:, LORA:]
    qq = q.double()
    s = (torch.einsum("qhd,khd->hqk", qq[..., :NOPE], k_nope) + torch.einsum("qhr,kr->hqk", qq[..., NOPE:], k_pe)) * SCALE
    visible = torch.arange(n)[None, :] <= (n - q_len + torch.arange(q_len))[:, None]
    s = s.masked_fill(~visible, -math.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v).reshape(q_len, HEADS * V_DIM)


CASES = [
    # id, cache_dtype, block_size, s_q, prefills (query, context), non_causal
    ("bf16-sq1-ps16", "auto", 16, 1, [], False),
    ("bf16-sq2-ps64", "auto", 64, 2, [], False),
    ("bf16-sq3-ps16", "auto", 16, 3, [], False),
    ("fp8-sq1-ps16", "fp8", 16, 1, [], False),
    ("fp8-sq2-ps16", "fp8", 16, 2, [], False),
    ("bf16-sq2-ps16-mixed", "auto", 16, 2, [(9, 0), (7, 21)], False),
    # fp8 prefill without cached context: vLLM's CPU context gather refuses quantized caches
    # (MLACommonBaseImpl._compute_prefill_context), a CUDA op does it on a GPU
    ("fp8-sq1-ps16-mixed", "fp8", 16, 1, [(5, 0)] if DEVICE.type == "cpu" else [(5, 30)], False),
    ("bf16-sq2-ps16-noncausal", "auto", 16, 2, [], True),
]


@pytest.mark.parametrize("cache_dtype,block_size,s_q,prefills,non_causal", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_forward_impl_matches_float64(vllm_world, model_dir, cache_dtype, block_size, s_q, prefills, non_causal,
                                      gen, request):
    from mla_dispatch.integrations.vllm import MLADispatchDecodeMetadata, MLADispatchImpl

    eng = _Layer(vllm_world, model_dir, request.node.callspec.id, block_size=block_size, cache_dtype=cache_dtype,
                 draft_tokens=s_q - 1, non_causal=non_causal, gen=gen)
    layer = eng.layer
    assert isinstance(layer.impl, MLADispatchImpl) and layer.impl.need_to_return_lse_for_decode is False
    k_scale = 1.0
    if cache_dtype != "auto":
        k_scale = 0.0625  # the per-tensor scale a checkpoint would bring (MLAAttention keeps it in _k_scale)
        layer._k_scale.fill_(k_scale)
        layer._k_scale_float = k_scale
    decode_lens = [int(n) for n in torch.randint(s_q, 90, (4,), generator=gen)] + [s_q]  # one with no history
    meta, reqs, table, num_blocks = _batch(gen, decode_lens, s_q, prefills, block_size, causal=not non_causal)
    md = eng.build(meta)
    assert md.num_decodes == len(decode_lens) and md.num_prefills == len(prefills)
    assert isinstance(md.decode, MLADispatchDecodeMetadata) and md.causal is (not non_causal)

    latents, cache = _fill_cache(gen, reqs, table, num_blocks, block_size, cache_dtype, k_scale)
    kv_c, k_pe = _new_tokens(latents, reqs)
    tokens = meta.num_actual_tokens
    q = ((torch.randn(tokens, HEADS, NOPE + ROPE, generator=gen) / 2).clamp(-2, 2)).to(torch.bfloat16)
    output = torch.full((tokens, HEADS * V_DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    with set_current_vllm_config(eng.cfg):
        layer.forward_impl(q.to(DEVICE), kv_c.to(DEVICE), k_pe.to(DEVICE), cache, md, output)
    output = output.cpu()
    assert not output.isnan().any(), "rows left unwritten (NaN-poisoned output)"

    # Decode rows: the absorbed query vLLM forms (bf16 bmm with W_UK_T), float64 attention over the cache,
    # rounded to bf16 as forward_mqa returns it, then W_UV.
    n_dec = md.num_decode_tokens
    w_uk_t, w_uv = layer.W_UK_T.detach().double(), layer.W_UV.detach().double()  # [H, nope, 512], [H, 512, v]
    ql = torch.einsum("thn,hnl->thl", q[:n_dec, :, :NOPE].double(), w_uk_t).to(torch.bfloat16)
    query = torch.cat([ql, q[:n_dec, :, NOPE:]], -1).reshape(len(decode_lens), s_q, HEADS, LORA + ROPE)
    seq = torch.tensor(decode_lens, dtype=torch.int32)
    case = _decode_case(query, cache, table[: len(decode_lens)], seq, cache_dtype, k_scale, not non_causal,
                        block_size)
    attn64, lse64 = naive_attention(case)
    want = torch.einsum("thl,hlv->thv", attn64.to(torch.bfloat16).double().reshape(n_dec, HEADS, LORA), w_uv)
    report = compare_outputs(output[:n_dec], None, want.reshape(n_dec, -1).float(), None, TOL)
    assert report, f"decode rows: {report.message}"

    # forward_mqa itself, as forward_impl calls it: (ql_nope, q_pe), the fp8-viewed cache; no LSE without DCP.
    kv_view = cache.view(torch.float8_e4m3fn) if cache_dtype != "auto" else cache
    o, lse = layer.impl.forward_mqa((ql.to(DEVICE), q[:n_dec, :, NOPE:].to(DEVICE)), kv_view, eng.build(meta), layer)
    assert lse is None
    report = compare_outputs(o.cpu().reshape(len(decode_lens), s_q, HEADS, LORA), None, attn64.float(), None, TOL)
    assert report, f"forward_mqa: {report.message}"

    # Prefill rows run on vLLM's own prefill path; they must be there, and right.
    start = n_dec
    for r, (n, q_len) in enumerate(reqs[len(decode_lens):], start=len(decode_lens)):
        rows = cache.cpu().view(-1, LORA + ROPE)[[int(table[r, j // block_size]) * block_size + j % block_size
                                                  for j in range(n - q_len)]]
        rows = rows.view(torch.float8_e4m3fn).double() * k_scale if cache_dtype != "auto" else rows.double()
        want_p = _prefill_reference(eng, q[start:start + q_len], latents[r], rows, n, q_len)
        got = output[start:start + q_len].double()
        cos = 1 - 2 * (got * want_p).sum() / (got.square().sum() + want_p.square().sum())
        assert cos < 1e-4, f"prefill request {r}: cosine difference {cos:.3g} (vLLM's bf16 prefill; bound 1e-4)"
        start += q_len


def test_dcp_lse_is_what_vllm_merges(vllm_world, model_dir, gen):
    """Under DCP vLLM sets need_to_return_lse_for_decode (AttentionImplBase.__new__ when dcp_world_size > 1) and
    merges ranks by the natural-log LSE: [T, N], -inf where a rank holds none of a request's tokens."""
    eng = _Layer(vllm_world, model_dir, "dcp", block_size=16, cache_dtype="auto", draft_tokens=0, non_causal=False,
                 gen=gen)
    impl = eng.layer.impl
    impl.need_to_return_lse_for_decode = True  # the value vLLM sets on a DCP rank; one rank here
    decode_lens = [int(n) for n in torch.randint(1, 70, (3,), generator=gen)] + [0]  # a rank with no tokens of req 3
    meta, reqs, table, num_blocks = _batch(gen, [max(n, 1) for n in decode_lens], 1, [], 16)
    meta.seq_lens[-1] = 0
    md = eng.build(meta)
    latents, cache = _fill_cache(gen, reqs, table, num_blocks, 16, "auto", 1.0)
    query = ((torch.randn(4, 1, HEADS, LORA + ROPE, generator=gen) / 4).clamp(-1, 1)).to(torch.bfloat16)
    o, lse = impl.forward_mqa(query.reshape(4, HEADS, -1).to(DEVICE), cache, md, eng.layer)
    case = _decode_case(query, cache, table, torch.tensor(decode_lens, dtype=torch.int32), "auto", 1.0, True, 16)
    want_o, want_l = naive_attention(case)
    want_l = torch.where(torch.isposinf(want_l), torch.full_like(want_l, -math.inf), want_l)  # empty: -inf
    assert lse is not None and lse.shape == (4, HEADS)
    report = compare_outputs(o.cpu().reshape(4, 1, HEADS, LORA), lse.cpu().reshape(4, HEADS, 1), want_o.float(),
                             want_l.float(), TOL)
    assert report, report.message
    assert torch.isneginf(lse[-1]).all()


def test_dcp_two_ranks_through_vllm(model_dir, tmp_path):
    """vLLM's DCP decode with our backend in two spawned ranks (TP 2 x DCP 2 over gloo; tests/vllm_dcp_ranks.py):
    vLLM's query gather, our builder on the local lengths, our forward_mqa on each rank's tokens against float64
    (natural-log LSE, -inf for an empty shard), the merged heads against float64 over every token, W_UV. vLLM's own
    merge is a Triton kernel that cannot run on a CPU: merge_shards over vLLM's DCP group stands in for it."""
    if DEVICE.type != "cpu":
        pytest.skip("the two ranks run on the CPU (gloo)")
    from dcp_ranks import spawn
    from tests.conftest import SEED
    import vllm_dcp_ranks

    cases = [dict(block_size=16, interleave=1, lengths=[37, 20, 61, 1]),   # request 3: rank 1 holds no token
             dict(block_size=16, interleave=4, lengths=[50, 9, 70, 3])]    # vLLM's cp_kv_cache_interleave_size
    path = str(tmp_path / "records")
    spawn(vllm_dcp_ranks.run, 2, (model_dir, cases, SEED, path), timeout_s=900, seed=SEED)
    for rank in range(2):
        with open(f"{path}.{rank}") as f:
            records = json.load(f)
        assert len(records) == len(cases)
        for r in records:
            assert r["status"] == "ok", f"rank {rank}, case {r['id']} (seed {r['seed']}): {r['message']}"


def test_vllm_accepts_the_backend(vllm_world):
    """vLLM's own checks of a backend (the GPU selector's validate_configuration), run on our class."""
    from mla_dispatch.integrations.vllm import MLADispatchBackend, capabilities

    cls = vllm_world
    assert cls is MLADispatchBackend and AttentionBackendEnum.CUSTOM.get_path() == VLLM_BACKEND_CLASS
    assert cls.supports_dcp() and cls.supports_non_causal() and cls.supports_non_causal_dcp()
    kwargs = dict(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=True,
                  has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                  device_capability=None, attn_type="decoder")
    assert cls.validate_configuration(**kwargs, use_dcp=True, use_non_causal=True) == []
    assert cls.validate_configuration(**{**kwargs, "kv_cache_dtype": "fp8"}) == []
    assert cls.validate_configuration(**{**kwargs, "use_sparse": True}) != []
    assert cls.supports_batch_invariance()
    assert cls.validate_configuration(**kwargs, use_batch_invariant=True) == []
    # Graph support follows the device: none where only the CPU reference runs.
    builder = cls.get_builder_cls()
    want = AttentionCGSupport.UNIFORM_BATCH if capabilities().cuda_graph else AttentionCGSupport.NEVER
    assert builder.get_cudagraph_support(None, None) == want
    if DEVICE.type == "cpu":
        assert want == AttentionCGSupport.NEVER


def test_causal_multi_token_under_dcp_is_refused(vllm_world, model_dir, gen):
    eng = _Layer(vllm_world, model_dir, "dcp_causal", block_size=16, cache_dtype="auto", draft_tokens=1,
                 non_causal=False, gen=gen)
    meta, reqs, table, num_blocks = _batch(gen, [20, 30], 2, [], 16)
    md = eng.build(meta)
    _, cache = _fill_cache(gen, reqs, table, num_blocks, 16, "auto", 1.0)
    eng.layer.impl.dcp_world_size = 2  # what a DCP rank's impl holds
    q = torch.zeros(4, HEADS, LORA + ROPE, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="dcp_world_size=2"):
        eng.layer.impl.forward_mqa(q, cache, md, eng.layer)


def test_steps_of_one_shape_update_one_plan(vllm_world, model_dir, gen):
    """Issue 55: the builder keeps a plan per decode shape across steps; the next step's first layer updates it with
    that step's table and lengths (DecodePlan.update) instead of planning anew, and its rows are those lengths'."""
    eng = _Layer(vllm_world, model_dir, "plan_reuse", block_size=16, cache_dtype="auto", draft_tokens=0,
                 non_causal=False, gen=gen)
    plans = []
    for step in range(3):
        batch = 5 if step < 2 else 3  # a third step of another batch size gets a plan of its own
        lens = [int(n) for n in torch.randint(1, 120, (batch,), generator=gen)]
        lens[0] = 119  # the same table width every step (vLLM's block table is as wide as a request may grow)
        meta, reqs, table, num_blocks = _batch(gen, lens, 1, [], 16)
        _, cache = _fill_cache(gen, reqs, table, num_blocks, 16, "auto", 1.0)
        q = ((torch.randn(batch, HEADS, LORA + ROPE, generator=gen) / 4).clamp(-1, 1)).to(torch.bfloat16)
        md = eng.build(meta)
        out, _ = eng.layer.impl.forward_mqa(q.to(DEVICE), cache, md, eng.layer)
        plans.append(md.decode.plan_slot.plan)
        case = _decode_case(q.view(batch, 1, HEADS, LORA + ROPE), cache, table, torch.tensor(lens, dtype=torch.int32),
                            "auto", 1.0, True, 16)
        attn64, _ = naive_attention(case)
        report = compare_outputs(out.cpu().reshape(batch, 1, HEADS, LORA), None, attn64.float(), None, TOL)
        assert report, f"step {step}: {report.message}"
    assert plans[1] is plans[0] and plans[2] is not plans[0]


def test_batch_invariant_mode(vllm_world, model_dir, gen, monkeypatch):
    """vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1, vllm/envs.py): forward_mqa plans with
    batch_invariant=True, and a request's rows are the same bits alone as inside the batch."""
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    if not envs.VLLM_BATCH_INVARIANT:
        pytest.skip("this vLLM does not read VLLM_BATCH_INVARIANT again after import")
    eng = _Layer(vllm_world, model_dir, "batch_invariant", block_size=16, cache_dtype="auto", draft_tokens=0,
                 non_causal=False, gen=gen)
    lens = [int(n) for n in torch.randint(30, 300, (6,), generator=gen)]
    meta, reqs, table, num_blocks = _batch(gen, lens, 1, [], 16)
    _, cache = _fill_cache(gen, reqs, table, num_blocks, 16, "auto", 1.0)
    q = ((torch.randn(6, HEADS, LORA + ROPE, generator=gen) / 4).clamp(-1, 1)).to(torch.bfloat16).to(DEVICE)
    md = eng.build(meta)
    out, _ = eng.layer.impl.forward_mqa(q, cache, md, eng.layer)
    assert md.decode.plan_slot.plan.problem.batch_invariant
    r = int(torch.randint(0, 6, (1,), generator=gen))
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    seq = torch.tensor([lens[r]], dtype=torch.int32)
    one = CommonAttentionMetadata(
        query_start_loc=qsl.to(DEVICE), query_start_loc_cpu=qsl, seq_lens=seq.to(DEVICE), num_reqs=1,
        num_actual_tokens=1, max_query_len=1, max_seq_len=lens[r], block_table_tensor=table[r:r + 1].to(DEVICE),
        slot_mapping=torch.full((1,), -1, dtype=torch.int64, device=DEVICE), seq_lens_cpu_upper_bound=seq,
        causal=True)
    alone, _ = eng.layer.impl.forward_mqa(q[r:r + 1], cache, eng.build(one), eng.layer)
    assert torch.equal(alone.reshape(-1), out.reshape(6, -1)[r])


# -- DeepSeek-V3.2's sparse MLA (MLA_DISPATCH_SPARSE) ------------------------------------------------------------


def test_sparse_backend_is_registered_and_accepted(vllm_world):
    """The plugin registers MLA_DISPATCH_SPARSE: vLLM resolves the name to our class, which is its FlashMLA-sparse
    backend with our impl, and vLLM's own validate_configuration accepts it for a sparse layer only."""
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

    from mla_dispatch.integrations.plugins import VLLM_SPARSE_BACKEND_CLASS, VLLM_SPARSE_BACKEND_NAME
    from mla_dispatch.integrations.vllm_sparse import MLADispatchSparseBackend, MLADispatchSparseImpl

    register_vllm()  # twice: idempotent
    member = AttentionBackendEnum[VLLM_SPARSE_BACKEND_NAME]
    assert member.get_path() == VLLM_SPARSE_BACKEND_CLASS and member.get_class() is MLADispatchSparseBackend
    cls = MLADispatchSparseBackend
    assert issubclass(cls, FlashMLASparseBackend) and cls.is_sparse() and cls.get_impl_cls() is MLADispatchSparseImpl
    assert cls.get_name() == VLLM_SPARSE_BACKEND_NAME
    kwargs = dict(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="fp8_ds_mla", block_size=64, use_mla=True,
                  has_sink=False, use_sparse=True, use_mm_prefix=False, use_per_head_quant_scales=False,
                  device_capability=None, attn_type="decoder")
    from vllm.platforms.interface import DeviceCapability

    hopper = DeviceCapability(9, 0)
    assert cls.validate_configuration(**{**kwargs, "device_capability": hopper}) == []
    assert cls.validate_configuration(**{**kwargs, "device_capability": hopper, "use_sparse": False}) != []


@pytest.mark.parametrize("h_q,s_q,page", [(16, 1, 64), (64, 2, 64), (20, 3, 128)])
def test_sparse_fp8_decode_hook_matches_float64(h_q, s_q, page, gen):
    """vLLM's FlashMLA-sparse impl launches every fp8 decode through ``_fp8_flash_mla_kernel(q, kv_c_and_k_pe_cache,
    topk_indices, kernel_metadata)``; ours answers it with mla_dispatch: vLLM's argument shapes (the cache as
    [pages, page, 656] bytes, cache token ids with -1 slots, q of any head count, where FlashMLA's kernel pads to
    64 / 128), the outputs checked against float64. The impl is made without vLLM's constructor, which needs a
    running engine (workspaces, the indexer); the method contract is checked against vLLM's own class."""
    import inspect

    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl

    from mla_dispatch.integrations.vllm_sparse import MLADispatchSparseImpl
    from mla_dispatch.numerics.cases import make_case

    theirs = list(inspect.signature(FlashMLASparseImpl._fp8_flash_mla_kernel).parameters)
    ours = list(inspect.signature(MLADispatchSparseImpl._fp8_flash_mla_kernel).parameters)
    assert ours == theirs  # a vLLM release that renames or reorders the hook fails here
    case = make_case(3, s_q, h_q, 300, page_size=page, topk=128, kv_format="fp8_ds_mla", generator=gen)
    impl = object.__new__(MLADispatchSparseImpl)
    impl.softmax_scale = case.softmax_scale
    vllm_cache = case.kv_cache.squeeze(2)  # [pages, page, 656], as vLLM holds it
    out, lse = impl._fp8_flash_mla_kernel(case.q, vllm_cache, case.indices, kernel_metadata=None)
    ref_out, ref_lse = naive_attention(case)
    report = compare_outputs(out, lse, ref_out.float(), ref_lse.float(), TOL)
    assert report, report.message
    out2, _ = impl._fp8_flash_mla_kernel(case.q, vllm_cache, case.indices, None)  # the plan is made once per shape
    assert len(impl._mla_dispatch_plans) == 1 and torch.equal(out2, out)


# -- DeepSeek-V4's attention layer (MLA_DISPATCH_SPARSE selects it) ------------------------------------------------


def test_dsv4_backend_name_selects_our_layer(vllm_world):
    """The plugin wraps vLLM's DeepSeek-V4 class selector (``_select_dsv4_attn_cls``, called by
    ``DeepseekV4DecoderLayer``) when vLLM imports the model module: MLA_DISPATCH_SPARSE then builds our layer, every
    other backend name vLLM's own (FlashMLA's layer for FLASHMLA_SPARSE); registering again does not wrap twice."""
    from vllm.config import AttentionConfig
    from vllm.models.deepseek_v4.nvidia import model as dsv4_model
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

    from mla_dispatch.integrations.plugins import VLLM_SPARSE_BACKEND_NAME
    from mla_dispatch.integrations.vllm_v4 import MLADispatchDeepseekV4Attention

    select = dsv4_model._select_dsv4_attn_cls
    assert getattr(select, "mla_dispatch_wrapped", False)
    register_vllm()
    assert dsv4_model._select_dsv4_attn_cls is select

    def picked(backend):
        return dsv4_model._select_dsv4_attn_cls(VllmConfig(attention_config=AttentionConfig(backend=backend)))

    assert picked(AttentionBackendEnum[VLLM_SPARSE_BACKEND_NAME]) is MLADispatchDeepseekV4Attention
    assert picked(AttentionBackendEnum.FLASHMLA_SPARSE) is DeepseekV4FlashMLAAttention
    assert issubclass(MLADispatchDeepseekV4Attention, DeepseekV4FlashMLAAttention)


@pytest.mark.parametrize("compress_ratio,h,padded,window,extra_topk", [(1, 16, 64, 128, 0), (128, 8, 64, 64, 96),
                                                                        (128, 64, 64, 32, 48)])
def test_dsv4_decode_matches_float64(vllm_world, compress_ratio, h, padded, window, extra_topk, gen):
    """vLLM's DeepSeek-V4 layer decodes in ``_forward_decode(q, kv_cache, swa_metadata, attn_metadata, swa_only,
    output)``; ours answers it with mla_dispatch: the sliding-window cache as the main cache (its indices cut by
    ``decode_swa_lens``), a C128A layer's compressed cache as the extra one (the indices and lengths vLLM's builder
    precomputed in ``DeepseekV4FlashMLAMetadata``), the per-head sink, q and output at vLLM's padded head count
    with only the rank's heads computed. vLLM's own metadata classes carry the arguments; the layer is made
    without vLLM's constructor (it needs the model's weights and workspaces) and the method contract is checked
    against vLLM's class. Outputs NaN-poisoned, checked against float64; the padding heads' rows must be 0."""
    import inspect
    import types

    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention
    from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLAMetadata
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

    from mla_dispatch.integrations.vllm_v4 import MLADispatchDeepseekV4Attention
    from mla_dispatch.numerics.cases import make_case

    theirs = list(inspect.signature(DeepseekV4FlashMLAAttention._forward_decode).parameters)
    assert list(inspect.signature(MLADispatchDeepseekV4Attention._forward_decode).parameters) == theirs
    swa_only = compress_ratio == 1
    t = 5  # decode tokens, one query position each (vLLM's convention for DeepSeek-V4)
    case = make_case(t, 1, h, 200, page_size=64, topk=window, topk_length=True, attn_sink=True,
                     extra_topk=extra_topk, extra_page_size=None if swa_only else 2,
                     extra_topk_length=not swa_only, head_dim_qk=512, head_dim_v=512, kv_format="fp8_ds_v4",
                     generator=gen)
    layer = object.__new__(MLADispatchDeepseekV4Attention)
    torch.nn.Module.__init__(layer)
    layer.n_local_heads, layer.scale, layer.compress_ratio, layer.topk_indices_buffer = h, case.softmax_scale, \
        compress_ratio, None
    sink = torch.randn(padded, generator=gen)  # vLLM's sink has the padded heads; the real ones come first
    sink[:h] = case.attn_sink
    layer.attn_sink = sink
    layer.swa_cache_layer = types.SimpleNamespace(kv_cache=case.kv_cache.squeeze(2))  # [blocks, 64, 584] bytes
    q = torch.zeros(t, padded, 512, dtype=case.q.dtype)  # vLLM's fused q kernel zero-fills the padding heads
    q[:, :h] = case.q[:, 0]
    swa_md = DeepseekSparseSWAMetadata(block_table=None, slot_mapping=None, block_size=64, num_decodes=t,
                                       num_decode_tokens=t, decode_swa_indices=case.indices,
                                       decode_swa_lens=case.topk_length,
                                       is_valid_token=torch.ones(t, dtype=torch.bool))
    attn_md, extra_cache = None, None
    if not swa_only:
        attn_md = DeepseekV4FlashMLAMetadata(
            num_reqs=t, max_query_len=1, max_seq_len=200, num_actual_tokens=t, query_start_loc=None,
            slot_mapping=None, block_table=None, req_id_per_token=None, block_size=2 * compress_ratio,
            topk_tokens=extra_topk, c128a_global_decode_topk_indices=case.extra_indices,
            c128a_decode_topk_lens=case.extra_topk_length)
        extra_cache = case.extra_kv_cache.squeeze(2)
    want_out, want_lse = naive_attention(case)
    for _ in range(2):  # the second step reuses the plan of the first
        output = torch.full((t, padded, 512), float("nan"), dtype=case.q.dtype)
        layer._forward_decode(q, extra_cache, swa_md, attn_md, swa_only, output)
        report = compare_outputs(output[:, None, :h], None, want_out.float(), None, TOL)
        assert report, report.message
        assert bool((output[:, h:] == 0).all())
    assert len(layer._mla_dispatch_plans) == 1
