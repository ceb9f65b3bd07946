"""mla_dispatch inside a real SGLang: our attention backend run on SGLang's own pool, layer and batch classes.

Skipped, with the reason, where SGLang does not import. Where it does: ``MLATokenToKVPool`` and
``ReqToTokenPool`` (SGLang's pools, page size 1 and 16, bf16 and float8_e4m3fn), ``RadixAttention``
(the layer), ``ForwardBatch`` / ``ForwardMode.DECODE``, ``KVWriteLoc`` writes, SGLang's parallel context
(one rank, no DCP) and the plugin's registry entry. ``MLADispatchAttnBackend`` is built by the factory
the plugin registered, from what a ``ModelRunner`` exposes to attention backends (``use_mla_backend``,
``page_size``, ``dtype``, ``device``, ``req_to_token_pool``, ``token_to_kv_pool``, ``kv_index_translator``);
a whole ``ModelRunner`` (model weights, process groups, graph runner) is not built. Non-decode batches are
delegated to SGLang's ``torch_native`` backend here (the default, ``triton``, needs a GPU).

Both calling conventions of ``forward_decode`` are run: ``q [T, H*576]`` with ``k [T, 1, 576]`` (written
with the pool's ``set_kv_buffer``), and ``q [T, H*512] + q_rope [T, H*64]`` with ``k``/``k_rope`` (written
with ``set_mla_kv_buffer``, a Triton kernel: on a CPU the new tokens are written with ``set_kv_buffer``
and the call passes ``save_kv_cache=False``). The result is checked against ``tests/oracle64`` over the
pool read token by token through ``req_to_token`` (page size 1), docs/design.md §5 tolerances. SGLang
gives a backend no output buffer, so the pool's unused slots are NaN instead: a stray read shows.

The DeepSeek-V3.2 sparse backend (``mla_dispatch_dsa``, a subclass of SGLang's ``DeepseekSparseAttnBackend``)
is checked at the end: its registration and factory, and its ``_forward_flashmla_kv`` hook against float64 over
SGLang's ``DSATokenToKVPool`` (SGLang's constructor, which needs a CUDA device and a model runner, is not run).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from mla_dispatch.numerics.cases import DecodeCase
from mla_dispatch.numerics.tolerance import compare_outputs
from oracle64 import naive_attention

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (pip install sglang==0.5.23): the engine tests cannot run here",
                allow_module_level=True)
try:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MLATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.runtime_context import get_parallel
except Exception as exc:  # a broken install: say what failed
    pytest.skip(f"SGLang is installed but does not import here: {exc!r}", allow_module_level=True)

import mla_dispatch  # noqa: E402
from mla_dispatch.integrations.plugins import SGLANG_BACKEND_NAME, register_sglang  # noqa: E402

TOL = mla_dispatch.get_backend("reference").TOLERANCE
HEADS, LORA, ROPE = 16, 512, 64
D = LORA + ROPE
SCALE = 192**-0.5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _RunnerView:
    """The attributes of SGLang's ModelRunner that attention backends read (the real pools)."""

    def __init__(self, pool, req_to_token_pool, page_size):
        self.use_mla_backend = True
        self.kv_index_translator = None  # a plain pool: ids in req_to_token are physical
        self.page_size = page_size
        self.dtype = torch.bfloat16
        self.device = DEVICE
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = pool


def _setup(gen, page_size, kv_dtype, lens):
    """SGLang's pools with the requests' history written (all but each request's last token), NaN elsewhere."""
    pages_needed = sum(-(-n // page_size) for n in lens) + 6
    size = pages_needed * page_size
    pool = MLATokenToKVPool(size=size, page_size=page_size, dtype=kv_dtype, kv_lora_rank=LORA, qk_rope_head_dim=ROPE,
                            layer_num=2, device=DEVICE, enable_memory_saver=False)
    buf = pool.kv_buffer[1]  # layer 1: the layer under test
    buf.view(torch.uint8).fill_(0xFF) if kv_dtype != torch.bfloat16 else buf.fill_(float("nan"))
    max_reqs = len(lens) + 3
    r2t = ReqToTokenPool(size=max_reqs, max_context_len=256, device=DEVICE, enable_memory_saver=False)
    r2t.req_to_token.copy_(torch.randint(0, 1 << 30, r2t.req_to_token.shape, generator=gen, dtype=torch.int32))
    # slot 0 .. page_size-1 is SGLang's padding page; pages are handed out in a random order
    free = (torch.randperm(pages_needed - 1, generator=gen) + 1).tolist()
    req_idx = (torch.randperm(max_reqs, generator=gen)[: len(lens)] + 1).tolist()
    for r, n in zip(req_idx, lens):
        slots = torch.cat([torch.arange(p * page_size, (p + 1) * page_size)
                           for p in [free.pop() for _ in range(-(-n // page_size))]])[:n]
        if page_size == 1:  # token slots need not be contiguous: shuffle them
            slots = slots[torch.randperm(n, generator=gen)]
        r2t.req_to_token[r, :n] = slots.to(torch.int32)
    return pool, r2t, req_idx


def _backend(pool, r2t, page_size):
    """``--attention-backend mla_dispatch`` as the plugin registered it, non-decode batches on torch_native."""
    from mla_dispatch.integrations.plugins import _create_sglang_backend
    from mla_dispatch.integrations.sglang import MLADispatchAttnBackend

    register_sglang()
    assert ATTENTION_BACKENDS[SGLANG_BACKEND_NAME] is _create_sglang_backend
    return MLADispatchAttnBackend(_RunnerView(pool, r2t, page_size), extend_backend="torch_native")


def _decode_batch(r2t, req_idx, lens):
    seq = torch.tensor(lens, device=DEVICE)
    out_loc = torch.stack([r2t.req_to_token[r, n - 1] for r, n in zip(req_idx, lens)]).to(torch.int64)
    return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=len(lens),
                        input_ids=torch.zeros(len(lens), dtype=torch.int64, device=DEVICE),
                        req_pool_indices=torch.tensor(req_idx, device=DEVICE), seq_lens=seq, out_cache_loc=out_loc,
                        seq_lens_sum=sum(lens), seq_lens_cpu=seq.cpu())


CASES = [  # id, page size, pool dtype, calling convention
    ("ps1-bf16-qk576", 1, torch.bfloat16, "q576"),
    ("ps1-bf16-qrope", 1, torch.bfloat16, "q_rope"),
    ("ps16-bf16-qk576", 16, torch.bfloat16, "q576"),
    ("ps16-bf16-qrope", 16, torch.bfloat16, "q_rope"),
    ("ps16-fp8-qk576", 16, torch.float8_e4m3fn, "q576"),
]


@pytest.mark.parametrize("page_size,kv_dtype,convention", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_forward_decode_matches_float64(page_size, kv_dtype, convention, gen):
    lens = [int(n) for n in torch.randint(2, 120, (4,), generator=gen)] + [1]  # one request: only the new token
    pool, r2t, req_idx = _setup(gen, page_size, kv_dtype, lens)
    backend = _backend(pool, r2t, page_size)
    layer = RadixAttention(HEADS, D, SCALE, 1, layer_id=1, v_head_dim=LORA)
    k_scale = 1.0
    if kv_dtype != torch.bfloat16:  # the per-tensor scale a checkpoint brings (RadixAttention.k_scale)
        k_scale = 0.0625
        layer.k_scale = torch.tensor(k_scale, device=DEVICE)
        layer.k_scale_float = k_scale

    # every token's latent; the history goes into the pool through SGLang's writer, the new token via forward
    latents = [((torch.randn(n, D, generator=gen) / 4).clamp(-1, 1)).to(torch.bfloat16) for n in lens]
    fb = _decode_batch(r2t, req_idx, lens)
    with get_parallel().override(dcp_enabled=False, attn_dcp_size=1):
        for r, n, lat in zip(req_idx, lens, latents):
            if n > 1:
                hist = KVWriteLoc(loc=r2t.req_to_token[r, : n - 1].to(torch.int64))
                k = lat[: n - 1].to(DEVICE) / k_scale if kv_dtype != torch.bfloat16 else lat[: n - 1].to(DEVICE)
                pool.set_kv_buffer(layer, hist, k.unsqueeze(1), None)
        new = torch.stack([lat[-1] for lat in latents]).to(DEVICE)  # [B, 576]
        q = ((torch.randn(len(lens), HEADS, D, generator=gen) / 2).clamp(-2, 2)).to(torch.bfloat16).to(DEVICE)
        backend.init_forward_metadata(fb)
        if convention == "q576":
            out = backend.forward(q.reshape(len(lens), HEADS * D), new.unsqueeze(1), new[:, None, :LORA], layer, fb)
        else:
            save = DEVICE == "cuda"  # set_mla_kv_buffer is a Triton kernel
            if not save:
                pool.set_kv_buffer(layer, KVWriteLoc(loc=fb.out_cache_loc), new.unsqueeze(1), None)
            out = backend.forward(q[..., :LORA].reshape(len(lens), HEADS * LORA), new[:, None, :LORA],
                                  new[:, None, :LORA], layer, fb, save_kv_cache=save,
                                  q_rope=q[..., LORA:].reshape(len(lens), HEADS * ROPE), k_rope=new[:, None, LORA:])
    assert out.shape == (len(lens), HEADS * LORA) and out.dtype == torch.bfloat16

    # The oracle reads the pool token by token through req_to_token (a page-size-1 view of the same buffer).
    buf = pool.kv_buffer[1].cpu()
    kv = buf.view(kv_dtype) if kv_dtype != torch.bfloat16 else buf
    width = max(lens)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for b, (r, n) in enumerate(zip(req_idx, lens)):
        table[b, :n] = r2t.req_to_token[r, :n].cpu()
    case = DecodeCase(q=q.cpu().unsqueeze(1), kv_cache=kv.view(-1, 1, 1, D), block_table=table,
                      cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                      kv_format="bf16" if kv_dtype == torch.bfloat16 else "fp8_e4m3",
                      kv_scale=None if kv_dtype == torch.bfloat16 else torch.tensor([k_scale]), indices=None,
                      causal=True, head_dim_v=LORA, softmax_scale=SCALE)
    want, _ = naive_attention(case)
    report = compare_outputs(out.cpu().reshape(len(lens), 1, HEADS, LORA), None, want.float(), None, TOL)
    assert report, report.message
    # the new tokens went where SGLang said (what the oracle read is what was written)
    stored = kv.view(-1, D)[fb.out_cache_loc.cpu()].float()
    want_new = torch.stack([lat[-1] for lat in latents]).float()
    if kv_dtype != torch.bfloat16:
        want_new = (want_new / k_scale).to(kv_dtype).float()
    assert torch.equal(stored, want_new)


def test_step_plan_is_shared_by_layers(gen):
    """One plan per step: the second layer's call reuses the first layer's plan (SGLang calls every layer with
    the same ForwardBatch after one init_forward_metadata)."""
    lens = [17, 40]
    pool, r2t, req_idx = _setup(gen, 16, torch.bfloat16, lens)
    backend = _backend(pool, r2t, 16)
    layers = [RadixAttention(HEADS, D, SCALE, 1, layer_id=i, v_head_dim=LORA) for i in (0, 1)]
    fb = _decode_batch(r2t, req_idx, lens)
    q = torch.randn(2, HEADS * D, generator=gen).to(torch.bfloat16).to(DEVICE)
    with get_parallel().override(dcp_enabled=False, attn_dcp_size=1):
        for layer in layers:
            k = torch.randn(2, 1, D, generator=gen).to(torch.bfloat16).to(DEVICE)
            for r, n in zip(req_idx, lens):
                pool.set_kv_buffer(layer, KVWriteLoc(loc=r2t.req_to_token[r, : n - 1].to(torch.int64)),
                                   torch.randn(n - 1, 1, D, generator=gen).to(torch.bfloat16).to(DEVICE), None)
            if layer.layer_id == 0:
                backend.init_forward_metadata(fb)
            out = backend.forward(q, k, k[..., :LORA], layer, fb)
            assert not out.isnan().any()
            if layer.layer_id == 0:
                plan = backend.forward_metadata.plan
    assert plan is not None and backend.forward_metadata.plan is plan


def test_steps_of_one_shape_update_one_plan(gen):
    """Issue 55: eager decode steps of one batch shape share a kept plan (the table's width rounded up to a power of
    two), each step updating it with its own table and lengths; a step's rows are its own lengths'."""
    lens = [17, 40, 23]
    pool, r2t, req_idx = _setup(gen, 16, torch.bfloat16, [n + 2 for n in lens])
    backend = _backend(pool, r2t, 16)
    layer = RadixAttention(HEADS, D, SCALE, 1, layer_id=1, v_head_dim=LORA)
    buf = pool.kv_buffer[1]
    buf.copy_(((torch.randn(buf.shape, generator=gen) / 4).clamp(-1, 1)).to(torch.bfloat16))  # every slot a value
    plans = []
    with get_parallel().override(dcp_enabled=False, attn_dcp_size=1):
        for step in range(3):
            step_lens = [n + step for n in lens]  # one more token per request and step, as decoding goes
            fb = _decode_batch(r2t, req_idx, step_lens)
            q = ((torch.randn(3, HEADS, D, generator=gen) / 2).clamp(-2, 2)).to(torch.bfloat16).to(DEVICE)
            new = buf[fb.out_cache_loc].reshape(3, D)  # the token already there: written again, unchanged
            backend.init_forward_metadata(fb)
            out = backend.forward(q.reshape(3, HEADS * D), new.unsqueeze(1), new[:, None, :LORA], layer, fb)
            plans.append(backend.forward_metadata.plan)
            table = torch.zeros(3, max(step_lens), dtype=torch.int32)
            for b, (r, n) in enumerate(zip(req_idx, step_lens)):
                table[b, :n] = r2t.req_to_token[r, :n].cpu()
            case = DecodeCase(q=q.cpu().unsqueeze(1), kv_cache=buf.cpu().view(-1, 1, 1, D), block_table=table,
                              cache_seqlens=torch.tensor(step_lens, dtype=torch.int32), kv_format="bf16",
                              kv_scale=None, indices=None, causal=True, head_dim_v=LORA, softmax_scale=SCALE)
            want, _ = naive_attention(case)
            report = compare_outputs(out.cpu().reshape(3, 1, HEADS, LORA), None, want.float(), None, TOL)
            assert report, f"step {step}: {report.message}"
    assert plans[0] is plans[1] is plans[2]


def test_decode_without_decode_metadata_is_refused(gen):
    pool, r2t, _ = _setup(gen, 1, torch.bfloat16, [4])
    backend = _backend(pool, r2t, 1)
    assert backend.extend_backend is not None and backend.forward_metadata is None
    with pytest.raises(ValueError, match="without decode metadata"):
        backend.forward_decode(torch.zeros(1, HEADS * D, dtype=torch.bfloat16), None, None,
                               RadixAttention(HEADS, D, SCALE, 1, layer_id=0, v_head_dim=LORA), None)


_TINY_DSV2 = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS, "kv_lora_rank": LORA, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": ROPE, "v_head_dim": 128, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "max_position_embeddings": 4096, "vocab_size": 1024,
    "torch_dtype": "bfloat16", "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_inference_plans_batch_invariant(deterministic, tmp_path, gen):
    """``--attention-backend mla_dispatch --enable-deterministic-inference`` passes SGLang's own check of the
    server arguments (the plugin adds the backend to SGLang's deterministic list), and under that configuration
    the decode plans batch_invariant=True: a request's rows are the same bits alone as inside the batch."""
    import json

    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    register_sglang()
    (tmp_path / "config.json").write_text(json.dumps(_TINY_DSV2))
    args = ServerArgs(model_path=str(tmp_path), attention_backend=SGLANG_BACKEND_NAME, skip_tokenizer_init=True,
                      enable_deterministic_inference=deterministic, device=DEVICE)
    lens = [int(n) for n in torch.randint(20, 200, (5,), generator=gen)]
    pool, r2t, req_idx = _setup(gen, 16, torch.bfloat16, lens)
    layer = RadixAttention(HEADS, D, SCALE, 1, layer_id=1, v_head_dim=LORA)
    q = ((torch.randn(len(lens), HEADS * D, generator=gen) / 2).clamp(-2, 2)).to(torch.bfloat16).to(DEVICE)
    with use_context(create_context(args, role="scheduler")), \
            get_parallel().override(dcp_enabled=False, attn_dcp_size=1):
        backend = _backend(pool, r2t, 16)
        assert backend.batch_invariant is deterministic
        for r, n in zip(req_idx, lens):  # every token, the new one too, through SGLang's writer
            lat = ((torch.randn(n, 1, D, generator=gen) / 4).clamp(-1, 1)).to(torch.bfloat16).to(DEVICE)
            pool.set_kv_buffer(layer, KVWriteLoc(loc=r2t.req_to_token[r, :n].to(torch.int64)), lat, None)

        def decode(rows):
            fb = _decode_batch(r2t, [req_idx[i] for i in rows], [lens[i] for i in rows])
            backend.init_forward_metadata(fb)
            k = pool.get_key_buffer(1).view(-1, D)[fb.out_cache_loc].unsqueeze(1)  # the new tokens, as written
            out = backend.forward(q[rows], k, k[..., :LORA], layer, fb, save_kv_cache=False)
            assert not out.isnan().any()
            assert backend.forward_metadata.plan.problem.batch_invariant is deterministic
            return out

        both = decode(list(range(len(lens))))
        if deterministic:
            r = int(torch.randint(0, len(lens), (1,), generator=gen))
            assert torch.equal(decode([r])[0], both[r])


# -- DeepSeek-V3.2's sparse attention (--attention-backend mla_dispatch_dsa) -------------------------------------


def _dsa_pool(kv_dtype, pages):
    """SGLang's DSA pool (64-token pages, two layers): fp8 stores the 656-byte fp8_ds_mla layout, bf16 576 values."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    with get_parallel().override(dcp_enabled=False, attn_dcp_size=1):
        return DSATokenToKVPool(size=(pages - 1) * 64, page_size=64, kv_lora_rank=LORA, dtype=kv_dtype,
                                qk_rope_head_dim=ROPE, layer_num=2, device=DEVICE, index_head_dim=128,
                                enable_memory_saver=False, kv_cache_dim=656 if kv_dtype != torch.bfloat16 else D)


def test_dsa_backend_is_registered_and_built(monkeypatch):
    """The plugin registers ``mla_dispatch_dsa`` (registry and CLI choices, idempotent) and leaves SGLang's ``dsa``
    alone; its factory builds our subclass of SGLang's DSA backend, decoding with ``flashmla_kv`` (our hook) on an
    fp8_ds_mla cache, SGLang's configured kernel on any other, refusing two-batch overlap; the name SGLang's
    DeepSeek model reads off the backend is ``dsa``, whose handler it then runs. SGLang's DSA constructor needs a
    CUDA device and a DSA model's runner: it is replaced by a stub that sets what ours reads (the pool's layout and
    the configured decode kernel); the pools are SGLang's own."""
    import types

    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
    from sglang.srt.models.deepseek_common.attention_backend_handler import (AttentionBackendRegistry,
                                                                             handle_attention_dsa)
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    from mla_dispatch.integrations import sglang_sparse
    from mla_dispatch.integrations.plugins import (SGLANG_DSA_BACKEND_NAME, SGLANG_REPLACE_DSA_ENV,
                                                   _create_sglang_dsa_backend)
    from mla_dispatch.integrations.sglang_sparse import MLADispatchDSABackend

    monkeypatch.delenv(SGLANG_REPLACE_DSA_ENV, raising=False)
    sglang_dsa = ATTENTION_BACKENDS["dsa"]
    register_sglang()
    register_sglang()  # idempotent
    assert ATTENTION_BACKENDS[SGLANG_DSA_BACKEND_NAME] is _create_sglang_dsa_backend
    assert ATTENTION_BACKEND_CHOICES.count(SGLANG_DSA_BACKEND_NAME) == 1
    assert ATTENTION_BACKENDS["dsa"] is sglang_dsa  # SGLang's own name untouched without the opt-in
    assert issubclass(MLADispatchDSABackend, DeepseekSparseAttnBackend)

    def stub_init(self, model_runner, *args, **kwargs):
        self.dsa_kv_cache_store_fp8 = model_runner.token_to_kv_pool.dsa_kv_cache_store_fp8
        self.kv_cache_dim = model_runner.token_to_kv_pool.kv_cache_dim
        self.dsa_decode_impl = model_runner.configured_decode

    monkeypatch.setattr(DeepseekSparseAttnBackend, "__init__", stub_init)
    fp8 = types.SimpleNamespace(token_to_kv_pool=_dsa_pool(torch.float8_e4m3fn, 2), configured_decode="fa3")
    backend = ATTENTION_BACKENDS[SGLANG_DSA_BACKEND_NAME](fp8)
    assert type(backend) is MLADispatchDSABackend
    assert backend.serves_fp8_ds_mla and backend.dsa_decode_impl == "flashmla_kv"
    # SGLang stamps the name that selected the backend (build_attention_backends); the model reads "dsa"
    backend.prefill_attention_backend_str = backend.decode_attention_backend_str = SGLANG_DSA_BACKEND_NAME
    assert backend.decode_attention_backend_str == backend.prefill_attention_backend_str == "dsa"
    assert backend.stamped_decode_attention_backend_str == SGLANG_DSA_BACKEND_NAME
    assert AttentionBackendRegistry.get_handler(backend.decode_attention_backend_str) is handle_attention_dsa
    assert AttentionBackendRegistry.get_handler(SGLANG_DSA_BACKEND_NAME) is not handle_attention_dsa  # why

    bf16 = types.SimpleNamespace(token_to_kv_pool=_dsa_pool(torch.bfloat16, 2), configured_decode="fa3")
    backend = ATTENTION_BACKENDS[SGLANG_DSA_BACKEND_NAME](bf16)
    assert not backend.serves_fp8_ds_mla and backend.dsa_decode_impl == "fa3"  # SGLang's kernel, unchanged

    monkeypatch.setattr(sglang_sparse, "_two_batch_overlap", lambda: True)
    with pytest.raises(ValueError, match="enable-two-batch-overlap"):
        ATTENTION_BACKENDS[SGLANG_DSA_BACKEND_NAME](fp8)


def test_dsa_replaces_sglangs_name_only_when_opted_in(monkeypatch):
    """With ``MLA_DISPATCH_SGLANG_REPLACE_DSA=1`` the plugin serves SGLang's own ``dsa`` name with our backend."""
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

    from mla_dispatch.integrations.plugins import SGLANG_REPLACE_DSA_ENV, _create_sglang_dsa_backend_as_dsa
    from mla_dispatch.integrations.sglang_sparse import MLADispatchDSABackend

    monkeypatch.setitem(ATTENTION_BACKENDS, "dsa", ATTENTION_BACKENDS["dsa"])  # restored after the test
    monkeypatch.setenv(SGLANG_REPLACE_DSA_ENV, "1")
    register_sglang()
    register_sglang()
    assert ATTENTION_BACKENDS["dsa"] is _create_sglang_dsa_backend_as_dsa

    def stub_init(self, model_runner, *args, **kwargs):
        self.dsa_kv_cache_store_fp8, self.kv_cache_dim, self.dsa_decode_impl = True, 656, "flashmla_kv"

    monkeypatch.setattr(DeepseekSparseAttnBackend, "__init__", stub_init)
    assert type(ATTENTION_BACKENDS["dsa"](None)) is MLADispatchDSABackend


def test_dsa_hook_keeps_sglangs_signature():
    """Our override has the parameters of SGLang's ``_forward_flashmla_kv`` (a release that renames or reorders
    them fails here), and SGLang's decode still reaches it through ``dsa_decode_impl == "flashmla_kv"``."""
    import inspect

    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

    from mla_dispatch.integrations.sglang_sparse import MLADispatchDSABackend

    theirs = list(inspect.signature(DeepseekSparseAttnBackend._forward_flashmla_kv).parameters)
    ours = list(inspect.signature(MLADispatchDSABackend._forward_flashmla_kv).parameters)
    assert ours == theirs
    source = inspect.getsource(DeepseekSparseAttnBackend.forward_decode)
    assert '"flashmla_kv"' in source and "self._forward_flashmla_kv(" in source


@pytest.mark.parametrize("h_q", [16, 64])
def test_dsa_flashmla_kv_hook_matches_float64(h_q, gen):
    """SGLang's DSA backend launches FlashMLA's sparse decode through ``_forward_flashmla_kv(q_all, kv_cache,
    v_head_dim, sm_scale, layer, metadata, page_table_1)``; ours answers it with mla_dispatch: SGLang's argument
    shapes (``q_all [T, h, 576]``; the cache as its ``DSATokenToKVPool`` hands it out, ``get_key_buffer`` ->
    ``[rows, 1, 656]`` float8_e4m3fn over the pool's bytes; cache token ids with -1 slots), any head count (16:
    FlashMLA's kernel pads to 64), a real ``RadixAttention``; the output checked against float64. The backend is
    made without SGLang's constructor (it needs a CUDA device and a model runner): only the attributes the hook
    reads are set (the pool's layout and page size). ``metadata`` is FlashMLA's scheduler data, which it does not
    read (None)."""
    from mla_dispatch.integrations.sglang_sparse import MLADispatchDSABackend
    from mla_dispatch.numerics.cases import make_case

    case = make_case(3, 1, h_q, 300, page_size=64, topk=128, kv_format="fp8_ds_mla", generator=gen)
    pages = case.kv_cache.shape[0]
    pool = _dsa_pool(torch.float8_e4m3fn, pages)
    pool.kv_buffer[1].copy_(case.kv_cache.reshape(-1, 1, 656).to(DEVICE))  # layer 1's bytes (uint8 storage)
    kv_cache = pool.get_key_buffer(1)  # what forward_decode passes
    assert kv_cache.shape == (pages * 64, 1, 656) and kv_cache.dtype == torch.float8_e4m3fn

    impl = object.__new__(MLADispatchDSABackend)
    impl.dsa_kv_cache_store_fp8 = pool.dsa_kv_cache_store_fp8
    impl.kv_cache_dim = pool.kv_cache_dim
    impl.physical_page_size = pool.page_size
    layer = RadixAttention(h_q, D, case.softmax_scale, 1, layer_id=1, v_head_dim=LORA)
    q_all = case.q.reshape(3, h_q, D).to(DEVICE)
    page_table_1 = case.indices[:, 0, :].to(DEVICE)
    out = impl._forward_flashmla_kv(q_all, kv_cache, layer.v_head_dim, layer.scaling, layer, None, page_table_1)
    assert out.shape == (3, 1, h_q, LORA) and out.dtype == torch.bfloat16
    want, _ = naive_attention(case)
    report = compare_outputs(out.cpu(), None, want.float(), None, TOL)
    assert report, report.message
    again = impl._forward_flashmla_kv(q_all, kv_cache, layer.v_head_dim, layer.scaling, layer, None, page_table_1)
    assert torch.equal(again, out) and len(impl._mla_dispatch_plans) == 1  # one plan per shape


def test_dsa_hook_leaves_other_caches_to_sglang(monkeypatch):
    """A cache not stored as fp8_ds_mla (here bf16) goes to SGLang's own ``_forward_flashmla_kv``, arguments
    unchanged."""
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

    from mla_dispatch.integrations.sglang_sparse import MLADispatchDSABackend

    seen = []
    monkeypatch.setattr(DeepseekSparseAttnBackend, "_forward_flashmla_kv",
                        lambda self, *args: seen.append(args) or "sglang's")
    impl = object.__new__(MLADispatchDSABackend)
    impl.dsa_kv_cache_store_fp8, impl.kv_cache_dim, impl.physical_page_size = False, D, 64
    args = (torch.zeros(2, HEADS, D), torch.zeros(128, 1, D), LORA, SCALE, object(), object(), torch.zeros(2, 8))
    assert impl._forward_flashmla_kv(*args) == "sglang's"
    assert len(seen) == 1 and all(a is b for a, b in zip(seen[0], args))


# -- DeepSeek-V4 (SGLang's dsv4 backend) through the flash_mla alias -------------------------------------------

_DSV4_CHILD = r'''
import functools, json, sys, warnings
import torch
sys.path.insert(0, TESTS_DIR)
from mla_dispatch.compat.flash_mla import FlashMLAShadowWarning, install_flash_mla_alias
with warnings.catch_warnings():
    warnings.simplefilter("ignore", FlashMLAShadowWarning)  # sgl-flash-mla is installed (it cannot load here)
    install_flash_mla_alias("current", shadow_installed=True)
from sglang.kernels.ops.attention import flash_mla_interface as fi
import mla_dispatch
from mla_dispatch.numerics.cases import make_case
from mla_dispatch.numerics.tolerance import compare_outputs
from oracle64 import naive_attention

tol = mla_dispatch.get_backend("reference").TOLERANCE
records = [{"alias": getattr(fi.flash_mla, "MLA_DISPATCH_ALIAS", None)}]
gen = torch.Generator().manual_seed(SEED)
# (h_q, SWA window, compressed top-k and its page size (0: an SWA-only layer), tokens); pages of 256 (SGLang's)
for h_q, window, extra_topk, extra_page, tokens in ((64, 128, 0, 0, 4), (16, 128, 512, 2, 3), (64, 64, 96, 64, 5)):
    case = make_case(tokens, 1, h_q, 600, page_size=256, topk=window, topk_length=True, attn_sink=True,
                     extra_topk=extra_topk, extra_page_size=extra_page or None, extra_topk_length=bool(extra_topk),
                     head_dim_qk=512, head_dim_v=512, kv_format="fp8_ds_v4", generator=gen)
    # DeepseekV4AttnBackend.__init__: functools.partial(flash_mla_interface.flash_mla_with_kvcache,
    # use_legacy=not interleaved), the V4 cache is not interleaved; its decode call (forward, sparse branch):
    call = functools.partial(fi.flash_mla_with_kvcache, use_legacy=True)
    meta = fi.get_mla_metadata()[0]  # DSV4AttnMetadata.init_flashmla_related: one per layer type and step
    want_out, want_lse = naive_attention(case)
    for layer in range(2):  # a second layer of the same type reuses the step's metadata
        o = call(q=case.q, k_cache=case.kv_cache, head_dim_v=512, block_table=None, cache_seqlens=None,
                 tile_scheduler_metadata=meta, softmax_scale=case.softmax_scale, is_fp8_kvcache=True,
                 indices=case.indices, topk_length=case.topk_length, attn_sink=case.attn_sink,
                 extra_k_cache=case.extra_kv_cache, extra_indices_in_kvcache=case.extra_indices,
                 extra_topk_length=case.extra_topk_length)[0]
        rep = compare_outputs(o.float(), None, want_out.float(), None, tol)
        records.append({"h_q": h_q, "extra": extra_topk, "layer": layer, "ok": bool(rep), "why": rep.message})
try:
    fi.flash_mla_mega_decode(case.q[:, 0], case.kv_cache, case.indices, torch.zeros(tokens, dtype=torch.int64),
                             torch.zeros(8, 64), case.softmax_scale)
    records.append({"mega": "returned"})
except NotImplementedError as exc:
    records.append({"mega": str(exc)})
print("RECORDS " + json.dumps(records))
'''


def test_dsv4_decode_through_sglangs_flash_mla_module():
    """SGLang's DeepSeek-V4 backend (``dsv4``, ``DeepseekV4AttnBackend``) decodes through its own FlashMLA module,
    ``sglang/kernels/ops/attention/flash_mla_interface.py``, which imports ``flash_mla`` (sgl-flash-mla). With
    mla_dispatch's alias in its place (``python -m mla_dispatch.compat.flash_mla install-pth --shadow-installed``, or
    in-process as here), that module imports and its ``flash_mla_with_kvcache`` runs the backend's exact V4 decode
    call (``use_legacy=True`` for the V4 cache, no table or lengths, a ``FlashMLASchedMeta`` per layer type and step
    reused by the next layer, indices with per-token lengths, the sink, the compressed cache as the extra one), checked
    against float64 on the reference backend; MegaAttention (``--dsv4-attn-backend flashmla_mega``) raises
    ``NotImplementedError``. In a child process: the alias replaces ``flash_mla`` for the whole process."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import SEED

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    code = _DSV4_CHILD.replace("TESTS_DIR", repr(tests_dir)).replace("SEED", str(SEED))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(tests_dir), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RECORDS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    records = json.loads(lines[-1][len("RECORDS "):])
    assert records[0] == {"alias": "current"}
    checked = [r for r in records if "ok" in r]
    assert len(checked) == 6 and all(r["ok"] for r in checked), checked
    assert "MegaAttention" in records[-1]["mega"], records[-1]
