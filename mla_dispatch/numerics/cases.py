"""Test data and comparisons shared by the tests, ``conformance`` and ``bench``.

Data are generated like FlashMLA's dense decode test
(``tests/test_flash_mla_dense_decoding.py``): ``q, kv ~ randn/10`` clamped to
±1; varlen lengths ``max(N(L, L/2), s_q)``; a random permutation of blocks in
the block table; NaN in every cache slot no request uses; table entries past a
request's length set to 2147480000 so a kernel that reads them faults or
poisons its result.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mla_dispatch.numerics.oracle import reference_attention
from mla_dispatch.numerics.tolerance import Tolerance
from mla_dispatch.kvcache.formats import empty_ds_v4_cache, pack_ds_mla, pack_ds_v4, quantize_fp8_e4m3

__all__ = ["DecodeCase", "make_case", "case_reference", "poisoned_outputs", "scale_outputs", "UNUSED_BLOCK_ID"]

UNUSED_BLOCK_ID = 2147480000


@dataclasses.dataclass
class DecodeCase:
    """One generated decode problem: the canonical inputs plus the fp32 values behind them."""

    q: torch.Tensor  # [B, s_q, h_q, D]
    kv_cache: torch.Tensor  # [nb, ps, h_kv, D or 656] in the storage format
    block_table: torch.Tensor  # int32 [B, max_blocks]
    cache_seqlens: torch.Tensor  # int32 [B]
    kv_format: str
    kv_scale: torch.Tensor | None
    indices: torch.Tensor | None
    causal: bool
    head_dim_v: int
    softmax_scale: float
    # sparse only, optional (make_case's topk_length / attn_sink / extra_topk)
    topk_length: torch.Tensor | None = None  # int32 [B]
    attn_sink: torch.Tensor | None = None  # fp32 [h_q]
    extra_kv_cache: torch.Tensor | None = None  # a second cache in kv_format, its own page size
    extra_indices: torch.Tensor | None = None  # int32 [B, s_q, extra_topk]
    extra_topk_length: torch.Tensor | None = None  # int32 [B]

    def sparse_extras(self) -> dict:
        """The optional sparse arguments the case has (keyword arguments of ``mla_decode`` / ``DecodePlan.run``)."""
        names = ("topk_length", "attn_sink", "extra_kv_cache", "extra_indices", "extra_topk_length")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def kwargs(self) -> dict:
        """Keyword arguments for ``mla_decode`` / ``plan_decode``."""
        return dict(head_dim_v=self.head_dim_v, softmax_scale=self.softmax_scale, causal=self.causal,
                    kv_format=self.kv_format, kv_scale=self.kv_scale, indices=self.indices, **self.sparse_extras())

    def args(self) -> tuple:
        return (self.q, self.kv_cache, self.block_table, self.cache_seqlens)


def make_case(
    batch: int,
    q_len: int,
    num_heads_q: int,
    seqlen: int,
    *,
    num_heads_kv: int = 1,
    head_dim_qk: int = 576,
    head_dim_v: int = 512,
    page_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    kv_format: str | None = None,
    varlen: bool = True,
    causal: bool = False,
    zero_len_rows: int = 0,
    topk: int = 0,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
    softmax_scale: float | None = None,
    extra_blocks: int = 2,
    topk_length: bool = False,
    attn_sink: bool = False,
    extra_topk: int = 0,
    extra_seqlen: int | None = None,
    extra_page_size: int | None = None,
    extra_topk_length: bool = False,
) -> DecodeCase:
    """Generate a decode case (see the module docstring for how).

    ``zero_len_rows`` requests (the last ones) get length 0. With ``topk > 0``
    sparse indices are drawn from each request's tokens, with some -1 entries; then, as FlashMLA's sparse
    test makes them (``tests/lib.py``): ``topk_length`` draws a per-request length in ``[0, topk]`` and fills
    the entries past it with ids far outside the cache (they must never be read); ``attn_sink`` draws a
    per-head sink ``~ N(0, 1)``, about a third of them ``+inf`` and a third ``-inf``; ``extra_topk > 0``
    adds a second cache of ``extra_seqlen`` tokens per request (default ``2 * extra_topk``) in pages of
    ``extra_page_size`` (default ``page_size``), with ``extra_topk`` indices into it (and
    ``extra_topk_length``, as ``topk_length``). ``kv_format="fp8_ds_v4"`` needs ``head_dim_qk = head_dim_v
    = 512``.
    """
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    kv_format = kv_format or ("bf16" if dtype == torch.bfloat16 else "fp16")
    if (topk_length or attn_sink or extra_topk) and not topk:
        raise ValueError("topk_length, attn_sink and extra_topk need topk > 0 (sparse)")
    lens, block_table, kv, kv_scale, indices, q = _scope(batch, q_len, seqlen, num_heads_kv, head_dim_qk, page_size,
                                                         kv_format, dtype, varlen, zero_len_rows, topk, g, extra_blocks,
                                                         q_heads=num_heads_q)
    dev = torch.device(device)
    extras = {}
    if topk_length:
        extras["topk_length"] = _cut(indices, g)
    if attn_sink:
        sink = torch.randn(num_heads_q, generator=g)
        pick = torch.randn(num_heads_q, generator=g)
        extras["attn_sink"] = torch.where(pick > 0.5, float("inf"), torch.where(pick < -0.5, float("-inf"), sink))
    if extra_topk:
        _, _, extras["extra_kv_cache"], _, extras["extra_indices"], _ = _scope(
            batch, q_len, extra_seqlen or 2 * extra_topk, num_heads_kv, head_dim_qk, extra_page_size or page_size,
            kv_format, dtype, varlen, zero_len_rows, extra_topk, g, extra_blocks, kv_scale=kv_scale)
        if extra_topk_length:
            extras["extra_topk_length"] = _cut(extras["extra_indices"], g)
    elif extra_topk_length:
        raise ValueError("extra_topk_length needs extra_topk > 0")
    return DecodeCase(
        q=q.to(dtype).to(dev),
        kv_cache=_cache_to(kv, kv_format, dev),
        block_table=block_table.to(torch.int32).to(dev),
        cache_seqlens=lens.to(torch.int32).to(dev),
        kv_format=kv_format,
        kv_scale=None if kv_scale is None else kv_scale.to(dev),
        indices=None if indices is None else indices.to(dev),
        causal=causal,
        head_dim_v=head_dim_v,
        softmax_scale=softmax_scale if softmax_scale is not None else head_dim_qk**-0.5,
        **{name: _cache_to(t, kv_format, dev) if name == "extra_kv_cache" else t.to(dev) for name, t in extras.items()},
    )


def _cache_to(kv: torch.Tensor, kv_format: str, dev: torch.device) -> torch.Tensor:
    """``kv`` on ``dev`` in the same layout: an ``fp8_ds_v4`` cache keeps its padded blocks (``Tensor.to`` of a view
    with gaps makes a dense copy, whose blocks of an odd page size no longer start at 16-byte boundaries)."""
    if kv_format != "fp8_ds_v4" or kv.device == dev:
        return kv.to(dev)
    moved = empty_ds_v4_cache(kv.shape[0], kv.shape[1], device=dev)
    moved.copy_(kv)
    return moved


def _cut(indices: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A per-request length in ``[0, topk]`` for ``indices`` (int32 ``[B]``); the entries past it are overwritten with
    ids far outside any cache (in place), which a kernel must never read."""
    batch, _, topk = indices.shape
    lengths = torch.randint(0, topk + 1, (batch,), generator=g, dtype=torch.int32)
    past = (torch.arange(topk)[None, None, :] >= lengths[:, None, None].long()).expand(indices.shape)
    garbage = torch.tensor([UNUSED_BLOCK_ID, 2147483647, -2147483648, -123456], dtype=torch.int32)
    pick = garbage[torch.randint(0, len(garbage), indices.shape, generator=g)]
    indices[past] = pick[past]
    return lengths


def _scope(batch, q_len, seqlen, num_heads_kv, head_dim_qk, page_size, kv_format, dtype, varlen, zero_len_rows, topk,
           g, extra_blocks, kv_scale=None, q_heads=0):
    """One cache and what addresses it: ``(lens int64 [B], block_table int64 [B, max_blocks], kv in kv_format,
    kv_scale, indices int32 [B, s_q, topk] or None, q)``. ``kv_scale`` is drawn for fp8_e4m3 unless given; q
    ``[B, s_q, q_heads, D_qk]`` fp32 is drawn (between the cache and the indices) when ``q_heads > 0``."""
    if varlen:
        lens = torch.normal(float(seqlen), seqlen / 2, (batch,), generator=g)
        lens = lens.round().clamp_min(q_len).to(torch.int64)
    else:
        lens = torch.full((batch,), seqlen, dtype=torch.int64)
    if zero_len_rows:
        lens[batch - zero_len_rows:] = 0
    max_len = int(lens.max().item()) if batch else 0
    max_blocks = max(1, math.ceil(max_len / page_size))
    num_blocks = batch * max_blocks + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    block_table = perm[: batch * max_blocks].view(batch, max_blocks).clone()

    values = (torch.randn(num_blocks, page_size, num_heads_kv, head_dim_qk, generator=g) / 10).clamp(-1, 1)
    # Poison: every slot past a request's length holds NaN, and table entries past
    # ceil(L / page_size) point far outside the cache.
    used = torch.zeros(num_blocks, page_size, dtype=torch.bool)
    for b in range(batch):
        n = int(lens[b])
        nb = math.ceil(n / page_size)
        for j in range(nb):
            used[block_table[b, j], : min(page_size, n - j * page_size)] = True
        block_table[b, nb:] = UNUSED_BLOCK_ID
    q = (torch.randn(batch, q_len, q_heads, head_dim_qk, generator=g) / 10).clamp(-1, 1) if q_heads else None

    if kv_format in ("bf16", "fp16"):
        kv = values.to(dtype)
        kv[~used] = float("nan")
    elif kv_format == "fp8_e4m3":
        if kv_scale is None:
            kv_scale = torch.tensor([values.abs().max().item() / 448.0 * 1.25], dtype=torch.float32)
        kv = quantize_fp8_e4m3(values, kv_scale)
        kv.view(torch.uint8)[~used] = 0x7F  # e4m3fn NaN
    elif kv_format == "fp8_ds_mla":
        kv = pack_ds_mla(values)
        nan_token = pack_ds_mla(torch.full((head_dim_qk,), float("nan")))
        kv[~used] = nan_token
    elif kv_format == "fp8_ds_v4":
        kv = pack_ds_v4(torch.where(used[:, :, None, None], values, float("nan")))  # NaN tokens: NaN scales
    else:
        raise ValueError(f"unknown kv_format {kv_format!r}")

    indices = None
    if topk:
        indices = torch.full((batch, q_len, topk), -1, dtype=torch.int64)
        for b in range(batch):
            n = int(lens[b])
            if n == 0:
                continue
            for i in range(q_len):
                k = min(topk, n)
                tok = torch.randperm(n, generator=g)[:k]
                slot = block_table[b, tok // page_size] * page_size + tok % page_size
                keep = torch.rand(k, generator=g) > 0.1  # ~10% skipped entries
                indices[b, i, :k] = torch.where(keep, slot, torch.full_like(slot, -1))
        indices = indices.to(torch.int32)
    return lens, block_table, kv, kv_scale, indices, q


def case_reference(case: DecodeCase, cache_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 reference of ``case``: out ``[B, s_q, h_q, D_v]`` and lse ``[B, h_q, s_q]`` (natural log).

    ``cache_seqlens`` replaces the case's lengths (a step that changed them); a 3-D cache ``[nb, ps, D]`` is read as
    one KV head, as ``mla_decode`` reads it.
    """
    kv = case.kv_cache if case.kv_cache.dim() == 4 else case.kv_cache.unsqueeze(2)
    lens = case.cache_seqlens if cache_seqlens is None else cache_seqlens
    kwargs = case.kwargs()
    if case.extra_kv_cache is not None and case.extra_kv_cache.dim() == 3:
        kwargs["extra_kv_cache"] = case.extra_kv_cache.unsqueeze(2)
    return reference_attention(case.q, kv, case.block_table, lens, **kwargs)


def poisoned_outputs(case: DecodeCase) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN-filled ``out`` ``[B, s_q, h_q, D_v]`` (q's dtype) and ``lse`` ``[B, h_q, s_q]`` (fp32) on q's device, for a
    run that must write every element of both."""
    b, s_q, h_q, _ = case.q.shape
    out = torch.full((b, s_q, h_q, case.head_dim_v), float("nan"), dtype=case.q.dtype, device=case.q.device)
    lse = torch.full((b, h_q, s_q), float("nan"), dtype=torch.float32, device=case.q.device)
    return out, lse


def scale_outputs(case: DecodeCase, scale: float, tol: Tolerance) -> Tolerance:
    """Make ``case``'s outputs ``scale`` times larger and leave its scores as drawn: the latent channels of the cache
    (bf16/fp16) are multiplied by ``scale`` and q's divided by it, in place. Returns ``tol`` with its absolute output
    bound scaled alike (docs/design.md §5's is for outputs of order 1e-3). For checks of outputs far outside fp16's range
    (partial rows stored in fp16 with a scale).

    Raises ValueError for an fp8 cache (its values cannot be scaled in place).
    """
    if case.kv_format not in ("bf16", "fp16"):
        raise ValueError(f"scale_outputs needs a bf16/fp16 cache, got kv_format={case.kv_format!r}")
    case.kv_cache[..., :case.head_dim_v].mul_(scale)
    case.q[..., :case.head_dim_v].div_(scale)
    return dataclasses.replace(tol, out_atol=tol.out_atol * scale)
