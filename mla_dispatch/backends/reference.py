"""The ``reference`` backend: :func:`mla_dispatch.numerics.oracle.reference_attention` (fp32 math on the
gathered cache) as a registered op, on any device. Slow; it is the oracle every other backend is tested against.
"""

from __future__ import annotations

import torch

from mla_dispatch.dispatch.backend import ArchSupport, BackendState, CGSupport, MLABackend
from mla_dispatch.dispatch.problem import DecodeProblem
from mla_dispatch.numerics.oracle import reference_attention

__all__ = ["ReferenceBackend"]


@torch.library.custom_op("mla_dispatch::reference_decode", mutates_args=("out", "lse"))
def reference_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    indices: torch.Tensor | None,
    kv_scale: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    kv_format: str,
    batch_invariant: bool = False,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> None:
    """Registered op: the reference written into ``out`` (q dtype) and ``lse`` (fp32); ``batch_invariant``: one
    request at a time; the optional sparse arguments as :func:`~mla_dispatch.numerics.oracle.reference_attention`
    takes them."""
    o, l = reference_attention(
        q,
        kv_cache,
        block_table,
        cache_seqlens,
        head_dim_v=out.shape[-1],
        softmax_scale=softmax_scale,
        causal=causal,
        kv_format=kv_format,
        kv_scale=kv_scale,
        indices=indices,
        batch_invariant=batch_invariant,
        topk_length=topk_length,
        attn_sink=attn_sink,
        extra_kv_cache=extra_kv_cache,
        extra_indices=extra_indices,
        extra_topk_length=extra_topk_length,
    )
    out.copy_(o)
    lse.copy_(l)


@reference_decode.register_fake
def _(q, kv_cache, block_table, cache_seqlens, indices, kv_scale, out, lse, softmax_scale, causal, kv_format,
      batch_invariant=False, topk_length=None, attn_sink=None, extra_kv_cache=None, extra_indices=None,
      extra_topk_length=None) -> None:
    return None


class ReferenceBackend(MLABackend):
    """fp32 PyTorch reference. Runs everything, everywhere; slow; the test oracle."""

    NAME = "reference"
    DESCRIPTION = "PyTorch fp32 reference (any device)"
    PLATFORMS = frozenset({"cpu", "cuda", "rocm", "npu"})
    KV_FORMATS = frozenset({"bf16", "fp16", "fp8_e4m3", "fp8_ds_mla", "fp8_ds_v4"})
    SUPPORTS_SPARSE = True
    SPARSE_EXTRAS = frozenset({"topk_length", "attn_sink", "extra_kv_cache", "extra_topk_length"})
    SUPPORTS_BATCH_INVARIANT = True  # one request at a time (reference_attention)
    CUDA_GRAPH = CGSupport.ALWAYS  # under capture its shapes come from block_table, not from seqlen values (oracle.py)
    ANY_OUT_STRIDES = True  # out.copy_(...)
    ARCH_SUPPORT = (ArchSupport("any", "any (CPU, every GPU)", notes="fp32 math on the gathered cache, slow; the "
                                                                      "oracle of every test",
                                run_here="yes: CPU, H100, H200"),)

    @classmethod
    def version(cls) -> str:
        return f"torch{torch.__version__.split('+')[0]}"

    @classmethod
    def run(cls, state: BackendState, q, kv_cache, block_table, cache_seqlens, *, problem: DecodeProblem,
            softmax_scale, kv_scale, indices, out, lse, topk_length=None, attn_sink=None, extra_kv_cache=None,
            extra_indices=None, extra_topk_length=None) -> None:
        torch.ops.mla_dispatch.reference_decode(
            q, kv_cache, block_table, cache_seqlens, indices, kv_scale, out, lse,
            softmax_scale, problem.causal, problem.kv_format, problem.batch_invariant,
            topk_length, attn_sink, extra_kv_cache, extra_indices, extra_topk_length,
        )
