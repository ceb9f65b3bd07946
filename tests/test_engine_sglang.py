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
