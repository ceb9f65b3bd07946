"""The Triton decode step as a registered op: ``torch.ops.mla_dispatch.triton_decode``.

One op, two launches: :func:`.decode.mla_decode_kernel` over the split-KV
schedule, then :func:`.combine.combine_kernel` for the requests it split. It is a
:func:`torch.library.triton_op` whose body launches through
:func:`torch.library.wrap_triton`, so ``torch.compile`` and ``torch.export`` see
the kernels (no graph break) and the fake implementation is the body itself
traced with fake tensors. It allocates nothing (the workspace comes from the
plan) and reads only shapes and strides on the host, so it can be captured in a
CUDA graph.

Under Triton's interpreter (``TRITON_INTERPRET=1`` when Triton was imported; the
CPU tests) the same body is registered as an opaque :func:`torch.library.custom_op`
with an empty fake implementation and launches plainly instead; see
``_TRACEABLE``. The schema is the same either way.

Importing this module imports Triton and registers the op.
"""

from __future__ import annotations

import torch
from triton.runtime.jit import JITFunction

from mla_dispatch.kernels.triton.combine import combine_kernel, launch_combine
from mla_dispatch.kernels.triton.decode import _clip_splits, launch_decode_kernel, mla_decode_kernel
from mla_dispatch.kvcache.formats import KV_FORMAT_CODES

__all__ = ["triton_decode", "decode_step", "traced_call"]

_NAME = "mla_dispatch::triton_decode"
_MUTATED = ("out", "lse", "partial_out", "partial_lse")

# False under Triton's interpreter, where @triton.jit gives an InterpretedFunction rather than a
# JITFunction. wrap_triton cannot trace those: torch 2.13 hands them back unwrapped, so the fake /
# functional trace of a triton_op body launches the interpreter on fake tensors and fails (opcheck:
# "set the storage of a tensor on device meta to a storage on device cpu"); torch 2.11 refuses them
# ("wrap_triton only works on functions annotated with triton.jit"). So there the kernels are
# launched plainly, inside an opaque custom op.
_TRACEABLE = isinstance(mla_decode_kernel, JITFunction)


def _launchable(kernel):
    """``kernel`` as the op body launches it: through wrap_triton, or plainly under the interpreter."""
    return torch.library.wrap_triton(kernel) if _TRACEABLE else kernel


def _triton_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    seqlens: torch.Tensor,
    indices: torch.Tensor | None,
    kv_scale: torch.Tensor | None,
    items: torch.Tensor,
    part_offsets: torch.Tensor,
    num_splits: torch.Tensor,
    first_slot: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    kv_format: str,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    tokens_on_m: bool,
    v_split: int,
    qk_chunk: int,
    max_registers: int,
    tma: bool,
    gluon: bool,
    fixed_splits: bool = False,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> None:
    """Split-KV MLA decode into ``out`` / ``lse`` (see :mod:`.decode` and :mod:`.combine`).

    Shapes: q ``[B, s_q, h_q, D_qk]`` bf16/fp16; kv_cache ``[nb, ps, h_kv, D_qk]``
    (bf16/fp16/fp8_e4m3) or ``[nb, ps, h_kv, 656]`` uint8/int8 (``fp8_ds_mla``);
    block_table int32 ``[B, max_blocks]`` (None when sparse); seqlens int32 ``[B]``
    (the cache lengths; the top-k width when sparse); indices int32 ``[B, s_q, topk]``
    (-1 = skip; None when dense); kv_scale fp32 ``[1]`` (``fp8_e4m3`` only, else None);
    items, part_offsets, num_splits, first_slot: the plan's split-KV schedule
    (:class:`mla_dispatch.metadata.schedule.SplitKVSchedule`, :func:`mla_dispatch.metadata.combine.first_slots`).
    Written: out ``[B, s_q, h_q, D_v]`` (q dtype), lse fp32 ``[B, h_q, s_q]`` (+inf for a
    row that sees no key), and the workspace: partial_out fp16 ``[max_slots, s_q, h_q, 2 D_v]``
    (:data:`.combine.PARTIAL_ROW_FORMAT`) / partial_lse fp32 ``[max_slots, s_q, h_q]``. The remaining scalars are
    the fields of :class:`.decode.KernelConfig` (``chunk_size`` lives in the schedule; ``tma`` and ``gluon`` apply to
    plain launches only, :func:`.decode.tma_applies`, :func:`.gluon_sm90.gluon_applies`). ``fixed_splits``: the
    schedule is a batch-invariant one (:func:`mla_dispatch.metadata.schedule.fixed_split_schedule`), whose split
    requests the combine finds per request, never per part boundary. Sparse only, optional: FlashMLA's
    ``topk_length`` / ``extra_topk_length`` (int32 ``[B]``), ``attn_sink`` (fp32 ``[h_q]``) and a second cache
    ``extra_kv_cache`` (``kv_cache``'s format) with int32 ``[B, s_q, extra_topk]`` ``extra_indices``; ``seqlens``
    then holds ``topk + extra_topk``.

    Raises ValueError for an unknown ``kv_format``.
    """
    _launch(_launchable(mla_decode_kernel), _launchable(combine_kernel), q, kv_cache, block_table, seqlens,
            indices, kv_scale, items, part_offsets, num_splits, first_slot, out, lse, partial_out, partial_lse,
            softmax_scale, causal, kv_format, block_m, block_n, num_warps, num_stages, tokens_on_m, v_split,
            qk_chunk, max_registers, tma, gluon, fixed_splits, topk_length, attn_sink, extra_kv_cache,
            extra_indices, extra_topk_length)


def _launch(decode_kernel, combine, q, kv_cache, block_table, seqlens, indices, kv_scale, items, part_offsets,
            num_splits, first_slot, out, lse, partial_out, partial_lse, softmax_scale, causal, kv_format, block_m,
            block_n, num_warps, num_stages, tokens_on_m, v_split, qk_chunk, max_registers, tma, gluon,
            fixed_splits=False, topk_length=None, attn_sink=None, extra_kv_cache=None, extra_indices=None,
            extra_topk_length=None) -> None:
    if kv_format not in KV_FORMAT_CODES:
        raise ValueError(f"kv_format={kv_format!r} (supported: {sorted(KV_FORMAT_CODES)})")
    kv = kv_cache.view(torch.uint8) if kv_cache.dtype == torch.int8 else kv_cache
    extra_kv = extra_kv_cache
    if extra_kv is not None and extra_kv.dtype == torch.int8:
        extra_kv = extra_kv.view(torch.uint8)
    launch_decode_kernel(
        decode_kernel, q, kv, block_table, seqlens, indices, kv_scale, items,
        part_offsets, out, lse, partial_out, partial_lse, softmax_scale=softmax_scale, causal=causal,
        kv_format=kv_format, block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
        tokens_on_m=tokens_on_m, v_split=v_split, qk_chunk=qk_chunk, max_registers=max_registers, tma=tma,
        gluon=gluon, topk_length=topk_length, attn_sink=attn_sink, extra_kv=extra_kv, extra_indices=extra_indices,
        extra_topk_length=extra_topk_length)
    launch_combine(partial_out, partial_lse, num_splits, first_slot, out, lse, items, part_offsets,
                   v_split=_clip_splits(v_split, qk_chunk, out.shape[-1])[0], kernel=combine,
                   fixed_splits=fixed_splits, attn_sink=attn_sink)


_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)  # functionalize, vmap
_dispatch_modes = torch._C._len_torch_dispatch_stack
_is_compiling = torch.compiler.is_compiling


def traced_call(*tensors) -> bool:
    """Whether a call on these tensors (None allowed) must reach the registered op: torch traces it (torch.compile,
    functorch transforms, fake / dispatch modes) or one is a tensor subclass. Plain eager calls launch directly."""
    return (_is_compiling() or _functorch_active() or _dispatch_modes() > 0
            or any(t is not None and type(t) is not torch.Tensor for t in tensors))


def decode_step(*args) -> None:
    """The op's arguments, run as the op whenever torch traces (:func:`traced_call`), as the op's body with plain
    launches otherwise (benchmarks; a plan's eager runs take its frozen launch, :mod:`.launch`). torch's Python-side
    handling of a 25-argument mutating op cost ~55 µs of host time per eager call on the device host (122 vs 68 µs);
    the kernels and grids are the same."""
    if traced_call(*(a for a in args if isinstance(a, torch.Tensor))):
        torch.ops.mla_dispatch.triton_decode.default(*args)
    else:
        _launch(mla_decode_kernel, combine_kernel, *args)


if _TRACEABLE:
    # the fake implementation is the body itself, traced with fake tensors (wrap_triton records the launches)
    triton_decode = torch.library.triton_op(_NAME, _triton_decode, mutates_args=_MUTATED)
else:
    triton_decode = torch.library.custom_op(_NAME, _triton_decode, mutates_args=_MUTATED)

    @triton_decode.register_fake
    def _(*args, **kwargs) -> None:
        return None
