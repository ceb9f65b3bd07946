"""The oracle: MLA decode attention in fp32 on the gathered cache, on any device.

Every backend is tested against it (FlashMLA's own test computes the same thing:
``tests/test_flash_mla_dense_decoding.py``), so it is written to be obviously right
rather than fast: gather every request's tokens through the block table, dequantise
them to fp32, mask what a query may not see, and take an exact softmax. Requests are
processed in groups so memory stays bounded for long contexts. The ``reference``
backend runs it; the tools and tests call it directly.
"""

from __future__ import annotations

import torch

from mla_dispatch.kvcache.formats import gather_tokens

__all__ = ["reference_attention"]

# Upper bound on fp32 elements materialised per request group (~1 GiB).
_GROUP_ELEMENTS = 1 << 28


def _softmax_rows(scores: torch.Tensor, values: torch.Tensor, v_eq: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact masked softmax: (P @ V, lse); rows with no finite score give (0, +inf). A masked key's p is 0, and
    ``0 * NaN`` is NaN: ``values`` must hold, for each row, only the keys it sees (zeros elsewhere)."""
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - torch.where(empty, torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum(v_eq, probs, values)
    lse = torch.where(empty, torch.full_like(lse, float("inf")), lse)
    return out, lse


def _gather_keys(kv_cache, ids, pos, live, kv_format, kv_scale):
    """The tokens at table positions ``pos`` (block ids ``ids``, same shape) of a request, dequantised to fp32
    ``[..., h_kv, D]``, zero where not ``live``; and where a live position's block id is outside the cache (read as
    block 0, never as an address). Returns ``(keys, bad)``."""
    num_blocks, page_size = kv_cache.shape[:2]
    bad = live & ((ids < 0) | (ids >= num_blocks))
    blocks = torch.where(live & ~bad, ids, 0)
    keys = gather_tokens(kv_cache, blocks, pos % page_size, kv_format, kv_scale)
    keys = torch.where(live[..., None, None], keys, torch.zeros((), device=keys.device))  # NaN never leaks
    return keys, bad


def _values_seen(values: torch.Tensor, visible: torch.Tensor, q_dim: int) -> torch.Tensor:
    """``values`` (keys' V channels, positions on dim ``q_dim``, no query dim) given a query dim at ``q_dim``, each
    query's copy zero at the positions it does not see (``visible``: ``[..., s_q, positions]``), so that a key the
    causal mask hides from a query (p = 0) adds exactly 0 to its out, not ``0 * NaN``."""
    mask = visible.reshape(*visible.shape, *([1] * (values.dim() - q_dim - 1)))
    return torch.where(mask, values.unsqueeze(q_dim), torch.zeros((), device=values.device))


def _tokens_to_read(lengths: torch.Tensor, cap: int) -> int:
    """How many table positions hold a token of some request: ``max(clamp(L, 0, cap))``, so the work grows with the
    tokens, not with the table's width. Reading it synchronises with the device; while a CUDA graph is being
    captured (where that is not allowed) every position is read instead, which gives the same result."""
    if lengths.numel() == 0:
        return 0
    if lengths.is_cuda and torch.cuda.is_current_stream_capturing():
        return cap
    return int(lengths.max().clamp(0, cap))


#: table positions per step of the batch-invariant dense reference: every step has this shape, whatever the table
_INVARIANT_CHUNK = 256


def _one_request_in_fixed_chunks(qf, kv_cache, table_row, seqlen, *, cap, head_dim_v, scale, causal, kv_format,
                                 kv_scale):
    """One dense request (``qf`` fp32 ``[s_q, h_kv, group, D]``) by an online softmax over chunks of
    :data:`_INVARIANT_CHUNK` table positions; returns fp32 ``out [s_q, h_kv, group, D_v]`` and ``lse [s_q, h_kv,
    group]`` (0 / +inf without keys, NaN for a bad block id among the request's entries).

    Every chunk has the same shape, and a chunk with no visible key leaves the state as it was (``torch.where``,
    not an update by zero), so a wider table, whose extra chunks see no key, gives the same bits: the chunks past
    the request's tokens are not computed at all.
    """
    q_len, h_kv, group, _ = qf.shape
    page_size = kv_cache.shape[1]
    dev = qf.device
    length = seqlen.long().clamp(0, cap)
    limit = seqlen.long().expand(q_len)
    if causal:
        limit = limit - q_len + 1 + torch.arange(q_len, device=dev)
    m = torch.full((q_len, h_kv, group), float("-inf"), device=dev)
    l = torch.zeros((q_len, h_kv, group), device=dev)
    acc = torch.zeros((q_len, h_kv, group, head_dim_v), device=dev)
    bad_any = torch.zeros((), dtype=torch.bool, device=dev)
    for c0 in range(0, _tokens_to_read(length, cap), _INVARIANT_CHUNK):
        pos = c0 + torch.arange(_INVARIANT_CHUNK, device=dev)
        live = pos < length
        ids = table_row.long()[(pos // page_size).clamp_max(table_row.shape[0] - 1)]
        keys, bad = _gather_keys(kv_cache, ids, pos, live, kv_format, kv_scale)  # [C, h_kv, D]
        bad_any = bad_any | bad.any()
        visible = live[None, :] & (pos[None, :] < limit[:, None])  # [s_q, C]
        scores = torch.einsum("sgrd,tgd->sgrt", qf, keys) * scale
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1))
        m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(scores - m_safe[..., None])
        seen = visible.any(-1)[:, None, None]  # the chunk has a key for the row: update, else keep the state
        l = torch.where(seen, l * alpha + p.sum(-1), l)
        values = keys[..., :head_dim_v]
        if causal and q_len > 1:
            acc_add = torch.einsum("sgrt,stgd->sgrd", p, _values_seen(values, visible, 0))
        else:
            acc_add = torch.einsum("sgrt,tgd->sgrd", p, values)
        acc = torch.where(seen[..., None], acc * alpha[..., None] + acc_add, acc)
        m = torch.where(seen, m_new, m)
    empty = l == 0
    out = torch.where(empty[..., None], torch.zeros_like(acc), acc / torch.where(empty, 1.0, l)[..., None])
    lse = torch.where(empty, torch.full_like(m, float("inf")), m + torch.log(l))
    nan = torch.full((), float("nan"), device=dev)
    return torch.where(bad_any, nan, out), torch.where(bad_any, nan, lse)


def reference_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    *,
    head_dim_v: int = 512,
    softmax_scale: float | None = None,
    causal: bool = False,
    kv_format: str = "bf16",
    kv_scale: torch.Tensor | float | None = None,
    indices: torch.Tensor | None = None,
    batch_invariant: bool = False,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode attention in fp32.

    Parameters are the canonical ones of :func:`mla_dispatch.mla_decode`
    (``kv_cache`` and ``extra_kv_cache`` must be 4-D ``[num_blocks, page_size, h_kv, D_qk or bytes]``).

    Sparse decoding attends to the tokens ``indices`` names, then those ``extra_indices`` names in
    ``extra_kv_cache`` (one softmax over both lists); only the first ``clamp(topk_length[b], 0, topk)``
    entries of request b's ``indices`` (likewise ``extra_topk_length``) are read, the rest are never looked
    at. ``attn_sink`` (fp32 ``[h_q]``) then scales head h's output by ``exp(lse) / (exp(lse) +
    exp(attn_sink[h]))`` (0 for a sink of ``+inf``, unchanged for ``-inf``); ``lse`` stays the keys' own.

    Request ``b``'s tokens are its first ``clamp(L_b, 0, max_blocks * page_size)``; the causal cut is
    counted from ``L_b``. Bad inputs never raise (nothing is read outside ``kv_cache``): a block id
    outside ``[0, num_blocks)`` among the table entries a request's tokens use makes all of that
    request's ``out`` rows and its ``lse`` NaN (a sparse index at or past ``num_blocks * page_size``:
    that query token's rows); other requests are unaffected.

    ``batch_invariant=True`` computes one request at a time (otherwise requests are batched in groups,
    whose size depends on the batch, and a batched matmul may round a request differently than a
    single one), a dense one by an online softmax over chunks of a fixed number of table positions
    (:func:`_one_request_in_fixed_chunks`): each request's result is then the same, bit for bit, whatever
    the batch around it and the width of the block table.

    Returns
    -------
    out : Tensor
        fp32 ``[B, s_q, h_q, head_dim_v]``; zeros for rows that see no key.
    lse : Tensor
        fp32 ``[B, h_q, s_q]``, natural log; ``+inf`` for rows that see no key.
    """
    batch, q_len, h_q, d_qk = q.shape
    num_blocks, page_size, h_kv, _ = kv_cache.shape
    group = h_q // h_kv
    scale = softmax_scale if softmax_scale is not None else d_qk**-0.5
    qf = q.float().view(batch, q_len, h_kv, group, d_qk)
    out = torch.zeros(batch, q_len, h_kv, group, head_dim_v, dtype=torch.float32, device=q.device)
    lse = torch.zeros(batch, q_len, h_kv, group, dtype=torch.float32, device=q.device)

    nan = torch.full((), float("nan"), device=q.device)
    if indices is not None:
        # Sparse: each query token attends to its own token lists (indices, then extra_indices); negative entries and
        # entries past topk_length are skipped, entries past the cache make that query token's rows NaN.
        lists = [(kv_cache, indices, topk_length)]
        if extra_kv_cache is not None:
            lists.append((extra_kv_cache, extra_indices, extra_topk_length))
        width = sum(ix.shape[-1] for _, ix, _ in lists)
        sink = None if attn_sink is None else attn_sink.float().view(h_kv, group)
        step = 1 if batch_invariant else max(1, _GROUP_ELEMENTS // max(1, q_len * width * h_kv * (d_qk + group)))
        for b0 in range(0, batch, step):
            keys, valid, poisoned = [], [], torch.zeros((), dtype=torch.bool, device=q.device)
            for cache, idx_all, lengths in lists:
                idx, ps = idx_all[b0 : b0 + step].long(), cache.shape[1]
                live = torch.ones_like(idx, dtype=torch.bool)
                if lengths is not None:
                    live = torch.arange(idx.shape[-1], device=q.device) < lengths[b0 : b0 + step, None, None].long()
                past = live & (idx >= cache.shape[0] * ps)
                ok = live & (idx >= 0) & ~past
                safe = torch.where(ok, idx, 0)
                k = gather_tokens(cache, safe // ps, safe % ps, kv_format, kv_scale)  # [g, s_q, k, h_kv, D]
                keys.append(torch.where(ok[..., None, None], k, torch.zeros((), device=q.device)))
                valid.append(ok)
                poisoned = poisoned | past.any(dim=-1)  # [g, s_q]
            keys, valid = torch.cat(keys, dim=2), torch.cat(valid, dim=2)
            scores = torch.einsum("bsgrd,bskgd->bsgrk", qf[b0 : b0 + step], keys) * scale
            scores = scores.masked_fill(~valid[:, :, None, None, :], float("-inf"))
            o, l = _softmax_rows(scores, keys[..., :head_dim_v], "bsgrk,bskgd->bsgrd")
            if sink is not None:
                # exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink); a row without keys stays 0
                factor = torch.where(torch.isposinf(l), torch.zeros_like(l), torch.sigmoid(l - sink))
                o = o * factor[..., None]
            poisoned = poisoned[:, :, None, None]  # [g, s_q, 1, 1]
            out[b0 : b0 + step] = torch.where(poisoned[..., None], nan, o)
            lse[b0 : b0 + step] = torch.where(poisoned, nan, l)
    else:
        if any(t is not None for t in (topk_length, attn_sink, extra_kv_cache, extra_indices, extra_topk_length)):
            raise ValueError("topk_length, attn_sink and the extra cache need sparse indices")
        # A request's tokens are its first clamp(L, 0, cap) (its table row addresses no more); a block id outside
        # [0, num_blocks) among the entries they use makes all its rows NaN (docs/design.md §1).
        max_blocks = block_table.shape[1]
        cap = max_blocks * page_size
        # Causal with s_q > 1: each query reads its own copy of the values (the keys it sees, zeros elsewhere).
        per_query_values = causal and q_len > 1
        if batch_invariant:
            for b in range(batch):
                out[b], lse[b] = _one_request_in_fixed_chunks(
                    qf[b], kv_cache, block_table[b], cache_seqlens[b], cap=cap, head_dim_v=head_dim_v, scale=scale,
                    causal=causal, kv_format=kv_format, kv_scale=kv_scale)
            return out.view(batch, q_len, h_q, head_dim_v), lse.view(batch, q_len, h_q).transpose(1, 2).contiguous()
        # The positions read are the longest request's tokens (of the whole batch for the group size, of each group
        # for its gather), not the table's width: a wide table of short requests costs what its tokens cost.
        width = _tokens_to_read(cache_seqlens, cap)
        per_position = h_kv * d_qk + q_len * h_q + (q_len * h_kv * head_dim_v if per_query_values else 0)
        step = max(1, _GROUP_ELEMENTS // max(1, width * per_position))
        for b0 in range(0, batch, step):
            seqlens = cache_seqlens[b0 : b0 + step].long()
            pos = torch.arange(_tokens_to_read(seqlens, width), device=q.device)
            live = pos[None, :] < seqlens[:, None]  # [g, n]
            ids = block_table[b0 : b0 + step].long()[:, pos // page_size]
            keys, bad = _gather_keys(kv_cache, ids, pos, live, kv_format, kv_scale)  # [g, n, h_kv, D]
            scores = torch.einsum("bsgrd,btgd->bsgrt", qf[b0 : b0 + step], keys) * scale
            # Key t is visible to query token i iff t < L and, if causal, t <= L - s_q + i.
            limit = seqlens[:, None].expand(-1, q_len)
            if causal:
                limit = limit - q_len + 1 + torch.arange(q_len, device=q.device)[None, :]
            visible = pos[None, None, :] < limit[:, :, None]  # [g, s_q, n]
            scores = scores.masked_fill(~visible[:, :, None, None, :], float("-inf"))
            if per_query_values:
                o, l = _softmax_rows(scores, _values_seen(keys[..., :head_dim_v], visible, 1),
                                     "bsgrt,bstgd->bsgrd")
            else:
                o, l = _softmax_rows(scores, keys[..., :head_dim_v], "bsgrt,btgd->bsgrd")
            poisoned = bad.any(dim=1)[:, None, None, None]  # [g, 1, 1, 1]
            out[b0 : b0 + step] = torch.where(poisoned[..., None], nan, o)
            lse[b0 : b0 + step] = torch.where(poisoned, nan, l)

    out = out.view(batch, q_len, h_q, head_dim_v)
    lse = lse.view(batch, q_len, h_q).transpose(1, 2).contiguous()
    return out, lse
