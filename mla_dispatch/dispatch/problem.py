"""The tensor-free description of one decode problem, and input validation.

:class:`DecodeProblem` is frozen and hashable: backend selection is cached on
it, and backends decide feasibility from it alone. :func:`describe_inputs`
checks the user's tensors against the canonical layout of docs/design.md §2 and
raises errors that name the argument, the expected and the given value.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mla_dispatch.kvcache.formats import (DS_V4_DIM, KV_FORMATS, check_ds_v4_cache, format_of_dtype, storage_dtype,
                                          token_bytes)

__all__ = ["DecodeProblem", "describe_inputs", "check_values", "KV_FORMATS"]

Q_DTYPES = (torch.bfloat16, torch.float16)
_FORMAT_OF_Q = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclasses.dataclass(frozen=True)
class DecodeProblem:
    """Everything about a decode call that decides which backend can run it.

    Shapes only, no tensors, no sequence lengths: the same problem (and the
    same selected backend) serves every layer and every step of a given batch
    geometry.
    """

    batch: int
    q_len: int  # s_q: query tokens per request
    num_heads_q: int
    num_heads_kv: int
    head_dim_qk: int
    head_dim_v: int
    page_size: int
    max_blocks: int
    q_dtype: torch.dtype
    kv_format: str
    causal: bool
    topk: int  # 0: dense (block_table); > 0: sparse `indices` of this width
    return_lse: bool
    device_type: str  # torch device type: "cpu", "cuda", "npu", ...
    cuda_graph: bool = False
    #: elements of the cache tensor, ``num_blocks * page_stride`` (0: unknown). Backends with 32-bit offsets
    #: decline caches too large for them; any page id in the table may be as large as num_blocks - 1.
    cache_numel: int = 0
    #: a request's out and lse must not depend on the rest of the batch (``plan_decode(batch_invariant=True)``)
    batch_invariant: bool = False
    #: sparse only: a per-request ``topk_length`` cuts ``indices`` short
    topk_length: bool = False
    #: sparse only: a per-head ``attn_sink`` scales the output
    attn_sink: bool = False
    #: sparse only: width of ``extra_indices`` into a second cache (0: none), that cache's page size and elements
    extra_topk: int = 0
    extra_page_size: int = 0
    extra_cache_numel: int = 0
    #: sparse only: a per-request ``extra_topk_length`` cuts ``extra_indices`` short
    extra_topk_length: bool = False
    #: elements between the starts of two blocks of the cache, and of the extra cache (``stride(0)``; 0: unknown).
    #: Kernels that read a block with vector loads need it aligned (an ``fp8_ds_v4`` cache of an odd page size
    #: without FlashMLA's padding to 576 bytes is not 16-byte aligned).
    kv_block_stride: int = 0
    extra_block_stride: int = 0

    @property
    def sparse(self) -> bool:
        return self.topk > 0

    @property
    def sparse_extras(self) -> tuple[str, ...]:
        """The optional sparse arguments the problem has, by their API names (empty for plain sparse or dense)."""
        names = (("topk_length", self.topk_length), ("attn_sink", self.attn_sink),
                 ("extra_kv_cache", self.extra_topk > 0), ("extra_topk_length", self.extra_topk_length))
        return tuple(name for name, present in names if present)

    @property
    def rows_per_kv_head(self) -> int:
        """Query rows sharing one KV head: s_q * h_q / h_kv (FlashMLA's q_seq_per_hk)."""
        return self.q_len * self.num_heads_q // self.num_heads_kv

    def describe(self, indent: str = "    ") -> str:
        """Indented multi-line summary used in error messages and ``explain``."""
        lines = [
            f"q            [{self.batch}, {self.q_len}, {self.num_heads_q}, {self.head_dim_qk}] {_dtype_name(self.q_dtype)}",
            f"kv_cache     page_size={self.page_size} h_kv={self.num_heads_kv} format={self.kv_format}",
            f"head_dim_v   {self.head_dim_v}",
            f"causal       {self.causal}",
            f"sparse       {'topk=' + str(self.topk) if self.sparse else 'no'}",
        ]
        if self.extra_topk:
            lines.append(f"extra cache  topk={self.extra_topk} page_size={self.extra_page_size}")
        extras = [n for n in self.sparse_extras if n != "extra_kv_cache"]
        if extras:
            lines.append(f"sparse args  {', '.join(extras)}")
        lines += [
            f"return_lse   {self.return_lse}",
            f"device       {self.device_type}",
            f"cuda_graph   {self.cuda_graph}",
        ]
        if self.batch_invariant:
            lines.append("batch_invariant True")
        return "\n".join(indent + line for line in lines)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _shape(t: torch.Tensor) -> str:
    return str(list(t.shape))


def describe_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    *,
    head_dim_v: int,
    causal: bool,
    kv_format: str,
    kv_scale: torch.Tensor | float | None,
    indices: torch.Tensor | None,
    return_lse: bool,
    cuda_graph: bool = False,
    batch_invariant: bool = False,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> DecodeProblem:
    """Validate the canonical inputs (metadata only, no data read) and build the problem.

    ``kv_cache`` and ``extra_kv_cache`` here are tensors, already unwrapped from a ``PagedMLACache``.

    Raises
    ------
    TypeError
        A non-tensor where a tensor is required (``q``, ``kv_cache``, ``block_table``, ``cache_seqlens``,
        ``indices``); the message names the argument and the dtype and shape expected.
    ValueError
        A dtype, rank, shape, device, layout or format mismatch; the message
        names the argument, what was expected and what was given.
    """
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")

    # q ------------------------------------------------------------------------
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D [batch, s_q, h_q, D_qk], got shape {_shape(q)}")
    if q.dtype not in Q_DTYPES:
        raise ValueError(f"q.dtype must be bfloat16 or float16, got {_dtype_name(q.dtype)}")
    if q.stride(-1) != 1:
        raise ValueError(f"q must be contiguous in its last dim (stride 1), got strides {list(q.stride())}")
    batch, q_len, num_heads_q, head_dim_qk = q.shape
    if q_len < 1:
        raise ValueError(f"q.shape[1] (s_q, query tokens per request) must be >= 1, got {q_len}")
    if num_heads_q < 1:
        raise ValueError(f"q.shape[2] (h_q) must be >= 1, got {num_heads_q}")

    # kv format ------------------------------------------------------------------
    if kv_format not in ("auto",) + KV_FORMATS:
        raise ValueError(f"kv_format must be one of 'auto', {', '.join(map(repr, KV_FORMATS))}; got {kv_format!r}")
    if kv_format == "auto":
        if kv_cache.dtype == q.dtype:
            kv_format = _FORMAT_OF_Q[q.dtype]
        else:
            guessed = format_of_dtype(kv_cache.dtype, kv_cache.shape[-1] if kv_cache.dim() else None)
            if guessed is None or guessed in ("bf16", "fp16"):
                raise ValueError(
                    f"kv_cache.dtype {_dtype_name(kv_cache.dtype)} does not match q.dtype {_dtype_name(q.dtype)} "
                    "and names no quantised format (float8_e4m3fn for 'fp8_e4m3', uint8 [..., 656] for 'fp8_ds_mla', "
                    "uint8 [..., 584] for 'fp8_ds_v4')"
                )
            kv_format = guessed
    expected_dtype = storage_dtype(kv_format)
    if kv_format in ("bf16", "fp16") and expected_dtype != q.dtype:
        raise ValueError(f"kv_format={kv_format!r} needs q.dtype {_dtype_name(expected_dtype)}, got {_dtype_name(q.dtype)}")
    packed_bytes = token_bytes(kv_format)
    ok_dtypes = (torch.uint8, torch.int8) if packed_bytes else (expected_dtype,)
    if kv_cache.dtype not in ok_dtypes:
        raise ValueError(
            f"kv_cache.dtype must be {' or '.join(_dtype_name(d) for d in ok_dtypes)} for kv_format={kv_format!r}, "
            f"got {_dtype_name(kv_cache.dtype)}"
        )

    # kv_cache -------------------------------------------------------------------
    if kv_cache.dim() == 3:
        kv_cache = kv_cache.unsqueeze(2)
    if kv_cache.dim() != 4:
        raise ValueError(
            f"kv_cache must be [num_blocks, page_size, h_kv, D_qk] or [num_blocks, page_size, D_qk], "
            f"got shape {_shape(kv_cache)}"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must be contiguous in its last dim, got strides {list(kv_cache.stride())}")
    num_blocks, page_size, num_heads_kv, last = kv_cache.shape
    if page_size < 1 or num_blocks < 1:
        raise ValueError(f"kv_cache needs num_blocks >= 1 and page_size >= 1, got shape {_shape(kv_cache)}")
    if packed_bytes:
        if last != packed_bytes:
            raise ValueError(
                f"kv_cache.shape[-1] must be {packed_bytes} bytes for kv_format={kv_format!r}, got {last}"
            )
        dims = (576, 512) if kv_format == "fp8_ds_mla" else (DS_V4_DIM, DS_V4_DIM)
        if (head_dim_qk, head_dim_v) != dims:
            raise ValueError(
                f"kv_format={kv_format!r} is defined for D_qk={dims[0]}, head_dim_v={dims[1]}; got D_qk={head_dim_qk}, "
                f"head_dim_v={head_dim_v}"
            )
        if kv_format == "fp8_ds_v4":
            check_ds_v4_cache(kv_cache)
    elif last != head_dim_qk:
        raise ValueError(f"kv_cache.shape[-1] (D_qk) must equal q.shape[-1]={head_dim_qk}, got {last}")
    if num_heads_kv < 1 or num_heads_q % num_heads_kv != 0:
        raise ValueError(f"h_q={num_heads_q} must be a multiple of h_kv (kv_cache.shape[2])={num_heads_kv}")
    if not 1 <= head_dim_v <= head_dim_qk:
        raise ValueError(f"head_dim_v must be in [1, D_qk={head_dim_qk}], got {head_dim_v}")
    if kv_format == "fp8_e4m3":
        if kv_scale is None:
            raise ValueError("kv_scale is required for kv_format='fp8_e4m3' (a float or a 1-element fp32 tensor)")
        if isinstance(kv_scale, torch.Tensor) and (kv_scale.numel() != 1 or kv_scale.dtype != torch.float32):
            raise ValueError(
                f"kv_scale must be a 1-element float32 tensor, got shape {_shape(kv_scale)} {_dtype_name(kv_scale.dtype)}"
            )
    elif kv_scale is not None:
        raise ValueError(f"kv_scale is only used with kv_format='fp8_e4m3', got one with kv_format={kv_format!r}")

    # block_table / cache_seqlens / indices -------------------------------------------
    device = q.device
    for name, t, dtype_shape in (("block_table", block_table, "int32 [batch, max_blocks]"),
                                 ("cache_seqlens", cache_seqlens, "int32 [batch]"),
                                 ("indices", indices, "int32 [batch, s_q, topk]")):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor ({dtype_shape}) on q's device, got {type(t).__name__} "
                            f"(e.g. torch.tensor({name}, dtype=torch.int32, device={str(device)!r}))")
    if kv_cache.device != device:
        raise ValueError(f"kv_cache is on {kv_cache.device}, q on {device}: they must be on the same device")
    topk = 0
    if indices is not None:
        if indices.dim() != 3 or tuple(indices.shape[:2]) != (batch, q_len) or indices.dtype != torch.int32:
            raise ValueError(
                f"indices must be int32 [batch={batch}, s_q={q_len}, topk], got shape {_shape(indices)} "
                f"{_dtype_name(indices.dtype)}"
            )
        if indices.device != device:
            raise ValueError(f"indices is on {indices.device}, q on {device}: they must be on the same device")
        topk = indices.shape[2]
        if topk < 1:
            raise ValueError(f"indices.shape[2] (topk) must be >= 1, got {topk}")
        if causal:
            raise ValueError("causal=True cannot be combined with sparse indices (the indexer already chose the keys)")
    extra = _describe_sparse_extras(q, kv_cache, kv_format, topk, topk_length, attn_sink, extra_kv_cache,
                                    extra_indices, extra_topk_length)
    max_blocks = 0
    if indices is None or block_table is not None:
        if block_table is None or cache_seqlens is None:
            raise ValueError("block_table and cache_seqlens are required unless sparse indices are given")
    if block_table is not None:
        if block_table.dim() != 2 or block_table.dtype != torch.int32:
            raise ValueError(
                f"block_table must be int32 [batch, max_blocks], got shape {_shape(block_table)} "
                f"{_dtype_name(block_table.dtype)}"
            )
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table.shape[0] must equal batch={batch} (q.shape[0]), got {block_table.shape[0]}")
        if block_table.stride(-1) != 1:
            raise ValueError(f"block_table must be contiguous in its last dim, got strides {list(block_table.stride())}")
        if block_table.device != device:
            raise ValueError(f"block_table is on {block_table.device}, q on {device}: they must be on the same device")
        max_blocks = block_table.shape[1]
    if cache_seqlens is not None:
        if cache_seqlens.shape != (batch,) or cache_seqlens.dtype != torch.int32:
            raise ValueError(
                f"cache_seqlens must be int32 [batch={batch}], got shape {_shape(cache_seqlens)} "
                f"{_dtype_name(cache_seqlens.dtype)}"
            )
        if cache_seqlens.device != device:
            raise ValueError(f"cache_seqlens is on {cache_seqlens.device}, q on {device}: they must be on the same device")

    return DecodeProblem(
        batch=batch,
        q_len=q_len,
        num_heads_q=num_heads_q,
        num_heads_kv=num_heads_kv,
        head_dim_qk=head_dim_qk,
        head_dim_v=head_dim_v,
        page_size=page_size,
        max_blocks=max_blocks,
        q_dtype=q.dtype,
        kv_format=kv_format,
        causal=bool(causal) and q_len > 1,
        topk=topk,
        return_lse=return_lse,
        device_type=device.type,
        cuda_graph=cuda_graph,
        cache_numel=kv_cache.shape[0] * kv_cache.stride(0),
        kv_block_stride=kv_cache.stride(0),
        batch_invariant=bool(batch_invariant),
        **extra,
    )


def _check_lengths(name: str, t: torch.Tensor | None, batch: int, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.shape != (batch,) or t.dtype != torch.int32:
        got = f"{_shape(t)} {_dtype_name(t.dtype)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be an int32 tensor [batch={batch}], got {got}")
    if t.device != device or t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous on {device}, got strides {list(t.stride())} on {t.device}")


def _describe_sparse_extras(q, kv_cache, kv_format, topk, topk_length, attn_sink, extra_kv_cache, extra_indices,
                            extra_topk_length) -> dict:
    """Check the optional sparse arguments (``topk_length``, ``attn_sink``, the extra cache); the problem fields."""
    given = [n for n, t in (("topk_length", topk_length), ("attn_sink", attn_sink), ("extra_kv_cache", extra_kv_cache),
                            ("extra_indices", extra_indices), ("extra_topk_length", extra_topk_length)) if t is not None]
    if not given:
        return {}
    if topk == 0:
        raise ValueError(f"{', '.join(given)} need sparse decoding: pass indices (dense decoding takes none of them)")
    batch, q_len, num_heads_q = q.shape[:3]
    device = q.device
    _check_lengths("topk_length", topk_length, batch, device)
    _check_lengths("extra_topk_length", extra_topk_length, batch, device)
    if attn_sink is not None:
        if (not isinstance(attn_sink, torch.Tensor) or attn_sink.shape != (num_heads_q,)
                or attn_sink.dtype != torch.float32):
            got = f"{_shape(attn_sink)} {_dtype_name(attn_sink.dtype)}" if isinstance(attn_sink, torch.Tensor) else \
                type(attn_sink).__name__
            raise ValueError(f"attn_sink must be a float32 tensor [h_q={num_heads_q}], got {got}")
        if attn_sink.device != device or attn_sink.stride(0) != 1:
            raise ValueError(f"attn_sink must be contiguous on {device}, got strides {list(attn_sink.stride())} on "
                             f"{attn_sink.device}")
    fields = dict(topk_length=topk_length is not None, attn_sink=attn_sink is not None,
                  extra_topk_length=extra_topk_length is not None)
    if (extra_kv_cache is None) != (extra_indices is None):
        raise ValueError("extra_kv_cache and extra_indices must be given together (a second cache and the token ids "
                         "to read from it)")
    if extra_kv_cache is None:
        if extra_topk_length is not None:
            raise ValueError("extra_topk_length needs extra_kv_cache and extra_indices")
        return fields
    if not isinstance(extra_kv_cache, torch.Tensor):
        raise TypeError(f"extra_kv_cache must be a torch.Tensor, got {type(extra_kv_cache).__name__}")
    if kv_format == "fp8_e4m3":
        raise ValueError("extra_kv_cache with kv_format='fp8_e4m3' is not supported (kv_scale is one scale, for "
                         "kv_cache); the extra cache must be in kv_cache's format")
    extra = extra_kv_cache.unsqueeze(2) if extra_kv_cache.dim() == 3 else extra_kv_cache
    if (extra.dim() != 4 or extra.dtype != kv_cache.dtype or extra.shape[2:] != kv_cache.shape[2:]
            or extra.stride(-1) != 1):
        raise ValueError(f"extra_kv_cache must be in kv_cache's format: [num_blocks, page_size, "
                         f"{', '.join(map(str, kv_cache.shape[2:]))}] {_dtype_name(kv_cache.dtype)}, contiguous in its "
                         f"last dim; got {_shape(extra_kv_cache)} {_dtype_name(extra_kv_cache.dtype)} strides "
                         f"{list(extra_kv_cache.stride())}")
    if extra.shape[0] < 1 or extra.shape[1] < 1:
        raise ValueError(f"extra_kv_cache needs num_blocks >= 1 and page_size >= 1, got shape {_shape(extra)}")
    if kv_format == "fp8_ds_v4":
        check_ds_v4_cache(extra, "extra_kv_cache")
    if extra.device != device:
        raise ValueError(f"extra_kv_cache is on {extra.device}, q on {device}: they must be on the same device")
    if (not isinstance(extra_indices, torch.Tensor) or extra_indices.dim() != 3
            or tuple(extra_indices.shape[:2]) != (batch, q_len) or extra_indices.dtype != torch.int32
            or extra_indices.shape[2] < 1):
        got = f"{_shape(extra_indices)} {_dtype_name(extra_indices.dtype)}" if isinstance(extra_indices, torch.Tensor) \
            else type(extra_indices).__name__
        raise ValueError(f"extra_indices must be int32 [batch={batch}, s_q={q_len}, extra_topk >= 1], got {got}")
    if extra_indices.device != device or extra_indices.stride(-1) != 1:
        raise ValueError(f"extra_indices must be on {device}, contiguous in its last dim; got strides "
                         f"{list(extra_indices.stride())} on {extra_indices.device}")
    fields.update(extra_topk=extra_indices.shape[2], extra_page_size=extra.shape[1],
                  extra_cache_numel=extra.shape[0] * extra.stride(0), extra_block_stride=extra.stride(0))
    return fields


def check_values(
    problem: DecodeProblem,
    num_blocks: int,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    indices: torch.Tensor | None,
    *,
    page_size: int | None = None,
    name: str = "indices",
    topk_length: torch.Tensor | None = None,
) -> None:
    """The ``validate=True`` checks: values, not just shapes (syncs with the device). ``page_size`` (default the
    problem's) and ``name`` are those of the cache ``indices`` address (the extra cache's for ``extra_indices``);
    entries past ``topk_length[b]`` (when given) are never read, so not checked.

    Raises
    ------
    ValueError
        Naming the offending rows: negative or over-capacity ``cache_seqlens``,
        block ids outside ``[0, num_blocks)`` in the used part of ``block_table``,
        sparse indices outside ``[-1, num_blocks * page_size)``.
    """
    ps = problem.page_size if page_size is None else page_size
    if cache_seqlens is not None:
        seqlens = cache_seqlens.to("cpu", torch.int64)
        bad = torch.nonzero(seqlens < 0).flatten().tolist()
        if bad:
            raise ValueError(f"cache_seqlens must be >= 0; rows {bad[:8]} are {seqlens[bad[:8]].tolist()}")
        if block_table is not None:
            cap = problem.max_blocks * ps
            bad = torch.nonzero(seqlens > cap).flatten().tolist()
            if bad:
                raise ValueError(
                    f"cache_seqlens exceed the block table's capacity max_blocks*page_size={cap} "
                    f"in rows {bad[:8]}: {seqlens[bad[:8]].tolist()}"
                )
            table = block_table.to("cpu", torch.int64)
            used = torch.arange(problem.max_blocks)[None, :] < ((seqlens + ps - 1) // ps)[:, None]
            out_of_range = used & ((table < 0) | (table >= num_blocks))
            bad = torch.nonzero(out_of_range.any(dim=1)).flatten().tolist()
            if bad:
                r = bad[0]
                cols = torch.nonzero(out_of_range[r]).flatten().tolist()[:4]
                raise ValueError(
                    f"block_table has block ids outside [0, {num_blocks}) within the requests' lengths, rows {bad[:8]} "
                    f"(row {r}, columns {cols}: {table[r, cols].tolist()})"
                )
    if indices is not None:
        idx = indices.to("cpu", torch.int64)
        limit = num_blocks * ps
        bad_mask = (idx < -1) | (idx >= limit)
        if topk_length is not None:
            bad_mask &= torch.arange(idx.shape[-1])[None, None, :] < topk_length.to("cpu", torch.int64)[:, None, None]
        bad = torch.nonzero(bad_mask.flatten(1).any(dim=1)).flatten().tolist()
        if bad:
            raise ValueError(f"{name} must be in [-1, num_blocks*page_size={limit}); offending batch rows {bad[:8]}")


def default_softmax_scale(head_dim_qk: int) -> float:
    """1/sqrt(D_qk). DeepSeek models need 1/sqrt(192) * mscale**2 instead: pass it explicitly."""
    return 1.0 / math.sqrt(head_dim_qk)
