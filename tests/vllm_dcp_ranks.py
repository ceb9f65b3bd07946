"""Ranks of vLLM's decode context parallelism with mla_dispatch's backend (tests/test_engine_vllm.py spawns two).

What is vLLM's own: its process groups (TP 2 x DCP 2 over gloo, 127.0.0.1), ``MLAAttention`` with our backend,
``ColumnParallelLinear`` holding this rank's shard of ``kv_b_proj``, our builder given vLLM's
``CommonAttentionMetadata`` (global ``seq_lens``, this rank's ``dcp_local_seq_lens``), and
``MLAAttention.forward_impl``, whose decode path all-gathers the absorbed query's heads over the DCP group, calls our
``forward_mqa`` on this rank's tokens, merges the ranks and projects with ``W_UV``. Each rank stores token ``t`` when
``(t // interleave) % 2 == rank``, at local position ``(t // (2 * interleave)) * interleave + t % interleave`` of the
shared block table's blocks (vLLM's DCP layout); the test writes the cache (vLLM's cache writer is a CUDA op).

What is not: vLLM's merge (``cp_lse_ag_out_rs`` in ``vllm/v1/attention/ops/dcp.py``) is a Triton kernel, and on a CPU
without triton-cpu vLLM has no Triton (``vllm/triton_utils/importing.py``: ``HAS_TRITON`` is False; the call fails
with "'function' object has no attribute 'arg_names'"). Here the layer's ``dcp_manager.combine`` is therefore the same
all-gather over vLLM's DCP group followed by :func:`mla_dispatch.merge_shards`, keeping this rank's heads as vLLM's
reduce-scatter does. Our side of vLLM's contract is checked directly: what ``forward_mqa`` returns on each rank (its
tokens only, the LSE in natural log, ``-inf`` where the rank holds none of a request's tokens) against float64 over
the rank's shard, and the layer's output heads against float64 over every token (``tests/oracle64.py``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig,  # noqa: E402
                         set_current_vllm_config)
from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel, get_dcp_group,  # noqa: E402
                              init_distributed_environment, initialize_model_parallel)
from vllm.model_executor.layers.attention.mla_attention import MLAAttention  # noqa: E402
from vllm.model_executor.layers.linear import ColumnParallelLinear  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from mla_dispatch import get_backend, merge_shards  # noqa: E402
from mla_dispatch.integrations.plugins import register_vllm  # noqa: E402
from mla_dispatch.numerics.cases import DecodeCase  # noqa: E402
from mla_dispatch.numerics.tolerance import compare_outputs  # noqa: E402
from oracle64 import naive_attention  # noqa: E402

WORLD = 2
HEADS, NOPE, ROPE, V_DIM, LORA = 16, 32, 64, 32, 512  # HEADS over both ranks (TP 2)
SCALE = (NOPE + ROPE) ** -0.5
TOL = get_backend("reference").TOLERANCE


def _config(model_dir: str, block_size: int, interleave: int) -> VllmConfig:
    model = ModelConfig(model=model_dir, dtype="bfloat16", max_model_len=1024, skip_tokenizer_init=True)
    parallel = ParallelConfig(tensor_parallel_size=WORLD, decode_context_parallel_size=WORLD,
                              cp_kv_cache_interleave_size=interleave)
    return VllmConfig(model_config=model, cache_config=CacheConfig(block_size=block_size, cache_dtype="auto"),
                      device_config=DeviceConfig(device="cpu"), parallel_config=parallel)


def _local_position(t: int, interleave: int) -> int:
    return (t // (WORLD * interleave)) * interleave + t % interleave


def run(rank: int, init_method: str, model_dir: str, cases: list[dict], seed: int, result_path: str) -> None:
    """Rank ``rank``: join vLLM's groups, run each case (``block_size``, ``interleave``, decode ``lengths``) and write
    its records as JSON to ``result_path.<rank>``."""
    with set_current_vllm_config(_config(model_dir, cases[0]["block_size"], cases[0]["interleave"])):
        init_distributed_environment(world_size=WORLD, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=init_method)
        initialize_model_parallel(WORLD, 1, decode_context_model_parallel_size=WORLD)
    records = []
    try:
        register_vllm()
        for i, case in enumerate(cases):
            record = {"id": f"bs{case['block_size']}-i{case['interleave']}", "rank": rank, "seed": seed + i}
            try:
                cfg = _config(model_dir, case["block_size"], case["interleave"])
                record.update(_decode(rank, cfg, f"dcp{i}", case["block_size"], case["interleave"], case["lengths"],
                                      seed + i))
            except Exception:  # noqa: BLE001 - the parent reads it
                record.update(status="fail", message=traceback.format_exc(limit=8))
            records.append(record)
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()
    with open(f"{result_path}.{rank}", "w") as f:
        json.dump(records, f)


def _merge_combine(rank: int, merged_heads: list):
    """vLLM's ``cp_lse_ag_out_rs`` on a CPU: all-gather each rank's ``out [T, H, D_v]`` and ``lse [T, H]`` over the
    DCP group, merge, keep this rank's heads (also appended to ``merged_heads``)."""
    def combine(out, lse, seq_lens=None, query_start_loc=None):
        group = get_dcp_group()
        outs = group.all_gather(out.contiguous(), dim=0).view(WORLD, *out.shape)
        lses = group.all_gather(lse.contiguous(), dim=0).view(WORLD, *lse.shape)
        merged, _ = merge_shards(outs.unsqueeze(2), lses.unsqueeze(-1))  # s_q = 1: one row per token
        heads = out.shape[1] // WORLD
        merged_heads.append(merged[:, 0, rank * heads:(rank + 1) * heads].clone())
        return merged[:, 0, rank * heads:(rank + 1) * heads].contiguous()
    return combine


def _decode(rank, cfg, name, block_size, interleave, lengths, seed) -> dict:
    gen = torch.Generator().manual_seed(seed)  # the same draws on every rank: one model, one batch
    local_heads = HEADS // WORLD
    mine = slice(rank * local_heads, (rank + 1) * local_heads)
    backend_cls = AttentionBackendEnum.CUSTOM.get_class()
    with set_current_vllm_config(cfg):
        kv_b_proj = ColumnParallelLinear(LORA, HEADS * (NOPE + V_DIM), bias=False, params_dtype=torch.bfloat16,
                                         prefix=f"{name}.kv_b_proj")
        layer = MLAAttention(num_heads=local_heads, scale=SCALE, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                             v_head_dim=V_DIM, q_lora_rank=None, kv_lora_rank=LORA, kv_b_proj=kv_b_proj,
                             cache_config=cfg.cache_config, prefix=f"{name}.attn", attn_backend=backend_cls)
        weight = (torch.randn(HEADS * (NOPE + V_DIM), LORA, generator=gen) / 8).to(torch.bfloat16)
        with torch.no_grad():  # this rank's output rows of kv_b_proj (ColumnParallelLinear's shard)
            kv_b_proj.weight.copy_(weight.view(HEADS, NOPE + V_DIM, LORA)[mine].reshape(-1, LORA))
        kv_b_proj.quant_method.process_weights_after_loading(kv_b_proj)
        layer.process_weights_after_loading(torch.bfloat16)
        builder = backend_cls.get_builder_cls()(layer.get_kv_cache_spec(cfg), [f"{name}.attn"], cfg,
                                                torch.device("cpu"))
    assert layer.impl.dcp_world_size == WORLD and layer.impl.need_to_return_lse_for_decode
    merged = []
    layer.dcp_manager.combine = _merge_combine(rank, merged)
    calls = []  # what forward_impl hands our forward_mqa and what it returns (observed, not changed)
    forward_mqa = layer.impl.forward_mqa

    def observed(q, kv_cache, attn_metadata, attn_layer):
        o, l = forward_mqa(q, kv_cache, attn_metadata, attn_layer)
        calls.append((q.clone(), o.clone(), None if l is None else l.clone()))
        return o, l

    layer.impl.forward_mqa = observed

    # One block table for both ranks (vLLM's DCP layout: a virtual block of WORLD * block_size tokens is block_size
    # tokens in each rank's block of that id), and every draw the same on each rank.
    batch = len(lengths)
    held = [[t for t in range(n) if (t // interleave) % WORLD == rank] for n in lengths]
    pages = [max(1, -(-n // (WORLD * block_size))) for n in lengths]
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(batch, max(pages) + 1, dtype=torch.int32)
    for b, p in enumerate(pages):
        table[b, :p] = torch.tensor([perm.pop() for _ in range(p)], dtype=torch.int32)
    latents = [((torch.randn(n, LORA + ROPE, generator=gen) / 4).clamp(-1, 1)).to(torch.bfloat16) for n in lengths]
    q = ((torch.randn(batch, HEADS, NOPE + ROPE, generator=gen) / 2).clamp(-2, 2)).to(torch.bfloat16)

    cache = torch.full((num_blocks, block_size, LORA + ROPE), float("nan"), dtype=torch.bfloat16)
    flat = cache.view(-1, LORA + ROPE)
    for b, tokens in enumerate(held):
        for t in tokens:
            k = _local_position(t, interleave)
            flat[int(table[b, k // block_size]) * block_size + k % block_size] = latents[b][t]
    local_lens = [len(h) for h in held]

    seq = torch.tensor(lengths, dtype=torch.int32)
    local = torch.tensor(local_lens, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    meta = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=batch, num_actual_tokens=batch,
        max_query_len=1, max_seq_len=int(seq.max()), block_table_tensor=table,
        slot_mapping=torch.full((batch,), -1, dtype=torch.int64), seq_lens_cpu_upper_bound=seq,
        dcp_local_seq_lens=local, dcp_local_seq_lens_cpu_upper_bound=local)
    with set_current_vllm_config(cfg):
        md = builder.build(0, meta)
    assert md.num_decodes == batch and torch.equal(md.decode.seq_lens.cpu(), local)

    new = torch.stack([lat[-1] for lat in latents])  # the step's new tokens (already in the cache, as vLLM writes)
    output = torch.full((batch, local_heads * V_DIM), float("nan"), dtype=torch.bfloat16)
    with set_current_vllm_config(cfg):
        layer.forward_impl(q[:, mine].contiguous(), new[:, :LORA].contiguous(), new[:, LORA:].unsqueeze(1).contiguous(),
                           cache, md, output)

    assert not output.isnan().any(), "rows left unwritten (NaN-poisoned output)"
    assert len(calls) == 1 and calls[0][2] is not None, "forward_mqa was not called once with the LSE returned"
    query, o_local, lse_local = calls[0]  # [T, H, 576] (every head, gathered), [T, H, 512], [T, H]
    failed = []

    # Our side of the contract: this rank's tokens only, natural-log LSE, -inf for a request it holds none of.
    shard = DecodeCase(q=query.view(batch, 1, HEADS, LORA + ROPE), kv_cache=cache.view(num_blocks, block_size, 1, -1),
                       block_table=table, cache_seqlens=local, kv_format="bf16", kv_scale=None, indices=None,
                       causal=True, head_dim_v=LORA, softmax_scale=SCALE)
    o64, l64 = naive_attention(shard)
    l64 = torch.where(torch.isposinf(l64), -math.inf, l64)  # vLLM's empty-shard convention
    report = compare_outputs(o_local.view(batch, 1, HEADS, LORA), lse_local.view(batch, HEADS, 1), o64.float(),
                             l64.float(), TOL)
    if not report:
        failed.append(f"forward_mqa on this rank's shard: {report.message}")

    # The merged attention of this rank's heads against float64 over every token (docs/design.md §5 bounds), and
    # the layer's output against W_UV applied to it.
    longest = max(lengths)
    whole = torch.full((batch * longest, 1, 1, LORA + ROPE), float("nan"), dtype=torch.bfloat16)
    for b, n in enumerate(lengths):
        whole[b * longest: b * longest + n, 0, 0] = latents[b]
    full = DecodeCase(q=query[:, mine].reshape(batch, 1, local_heads, LORA + ROPE), kv_cache=whole,
                      block_table=torch.arange(batch * longest, dtype=torch.int32).view(batch, longest),
                      cache_seqlens=seq, kv_format="bf16", kv_scale=None, indices=None, causal=True,
                      head_dim_v=LORA, softmax_scale=SCALE)
    attn64, _ = naive_attention(full)
    report = compare_outputs(merged[0].view(batch, 1, local_heads, LORA), None, attn64.float(), None, TOL)
    if not report:
        failed.append(f"merged attention: {report.message}")
    want = torch.einsum("thl,hlv->thv", merged[0].double(), layer.W_UV.detach().double())  # [T, heads, V]
    report = compare_outputs(output, None, want.reshape(batch, -1).float(), None, TOL)
    if not report:
        failed.append(f"layer output (W_UV of the merged attention): {report.message}")
    return {"status": "fail" if failed else "ok",
            "message": "; ".join(failed) or f"ok, local lengths {local_lens} of {lengths}"}
