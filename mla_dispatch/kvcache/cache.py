"""The paged MLA KV cache: blocks, per-sequence tables, slot-mapped writes.

One latent KV "head" per token (``[kv_c (512) | k_pe (64)]`` for DeepSeek),
stored in fixed-size pages. This mirrors what serving engines keep: vLLM's
``[num_blocks, block_size, 576]`` cache written by ``concat_and_cache_mla``
through a slot mapping, SGLang's token pool written by ``set_mla_kv_buffer``.
Writes quantise for the fp8 formats (see :mod:`mla_dispatch.kvcache.formats`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence

import torch

from mla_dispatch.kvcache.formats import (DS_MLA_TOKEN_BYTES, DS_V4_DIM, KV_FORMATS, empty_ds_v4_cache,
                                          gather_tokens, pack_ds_mla, quantize_fp8_e4m3, storage_dtype, write_ds_v4)

__all__ = ["PagedMLACache", "CacheFullError"]


class CacheFullError(RuntimeError):
    """Not enough free blocks for an append; nothing was written."""


@dataclasses.dataclass
class _Sequence:
    blocks: list[int]
    length: int


class PagedMLACache:
    """A block-paged MLA KV cache with a block allocator.

    Parameters
    ----------
    num_blocks, page_size : int
        Capacity is ``num_blocks * page_size`` tokens.
    head_dim : int
        ``D_qk`` values per token (DeepSeek: 576).
    num_heads_kv : int
        KV heads (DeepSeek: 1).
    kv_format : {"bf16", "fp16", "fp8_e4m3", "fp8_ds_mla", "fp8_ds_v4"}
        ``"fp8_ds_v4"`` (DeepSeek-V4) needs ``head_dim=512`` and one KV head.
    kv_scale : float, optional
        Per-tensor scale for ``"fp8_e4m3"`` (values saturate at ``±448 * kv_scale``).
    device : str or torch.device

    Attributes
    ----------
    kv : Tensor
        ``[num_blocks, page_size, num_heads_kv, head_dim]`` (``uint8 [..., 656]`` for
        ``"fp8_ds_mla"``; for ``"fp8_ds_v4"`` ``uint8 [num_blocks, page_size, 1, 584]``, a view of
        blocks padded to a multiple of 576 bytes, FlashMLA's layout); pass the cache object (or this
        tensor) to ``mla_decode``.

    Examples
    --------
    >>> cache = PagedMLACache(num_blocks=8, page_size=16)
    >>> cache.add_sequence("a")
    >>> cache.append("a", torch.randn(20, 576))
    >>> table, lens = cache.decode_inputs(["a"])
    """

    def __init__(self, num_blocks: int, page_size: int, *, head_dim: int = 576, num_heads_kv: int = 1,
                 kv_format: str = "bf16", kv_scale: float | None = None, device: str | torch.device = "cpu"):
        if num_blocks < 1 or page_size < 1:
            raise ValueError(f"num_blocks and page_size must be >= 1, got {num_blocks}, {page_size}")
        if kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
        if kv_format == "fp8_e4m3" and (kv_scale is None or not kv_scale > 0):
            raise ValueError(f"kv_format='fp8_e4m3' needs a positive kv_scale, got {kv_scale!r}")
        if kv_format == "fp8_ds_mla" and (head_dim != 576 or num_heads_kv != 1):
            raise ValueError(f"kv_format='fp8_ds_mla' stores 576-value tokens with one KV head, got head_dim={head_dim}, "
                             f"num_heads_kv={num_heads_kv}")
        if kv_format == "fp8_ds_v4" and (head_dim != DS_V4_DIM or num_heads_kv != 1):
            raise ValueError(f"kv_format='fp8_ds_v4' stores {DS_V4_DIM}-value tokens with one KV head, got "
                             f"head_dim={head_dim}, num_heads_kv={num_heads_kv}")
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.head_dim = head_dim
        self.num_heads_kv = num_heads_kv
        self.kv_format = kv_format
        self.device = torch.device(device)
        self.kv_scale = (torch.tensor([kv_scale], dtype=torch.float32, device=self.device)
                         if kv_format == "fp8_e4m3" else None)
        if kv_format == "fp8_ds_v4":
            self.kv = empty_ds_v4_cache(num_blocks, page_size, device=self.device)
        else:
            last = DS_MLA_TOKEN_BYTES if kv_format == "fp8_ds_mla" else head_dim
            self.kv = torch.zeros(num_blocks, page_size, num_heads_kv, last, dtype=storage_dtype(kv_format),
                                  device=self.device)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._seqs: dict[Hashable, _Sequence] = {}

    # -- bookkeeping -----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def seq_len(self, seq_id: Hashable) -> int:
        return self._get(seq_id).length

    def _get(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r} (known: {list(self._seqs)[:8]})") from None

    def add_sequence(self, seq_id: Hashable) -> None:
        """Start an empty sequence. Raises ValueError if ``seq_id`` exists."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        self._seqs[seq_id] = _Sequence(blocks=[], length=0)

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence and return its blocks to the allocator."""
        seq = self._get(seq_id)
        self._free.extend(reversed(seq.blocks))
        del self._seqs[seq_id]

    # -- writes ------------------------------------------------------------------------

    def _normalise(self, values: torch.Tensor) -> torch.Tensor:
        if values.dim() == 2:
            values = values.unsqueeze(1)
        if values.dim() != 3 or values.shape[1:] != (self.num_heads_kv, self.head_dim):
            raise ValueError(f"values must be [n, {self.num_heads_kv}, {self.head_dim}] (or [n, {self.head_dim}] for one "
                             f"KV head), got {list(values.shape)}")
        if not values.is_floating_point():
            raise ValueError(f"values must be floating point, got {values.dtype}")
        return values.to(self.device)

    def append(self, seq_id: Hashable | Sequence[Hashable], values: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """Append tokens to one sequence, or to several at once (all or nothing).

        Parameters
        ----------
        seq_id : hashable or sequence of hashables
        values : Tensor or sequence of Tensors
            ``[n, h_kv, D]`` (or ``[n, D]``) per sequence, any float dtype.

        Returns
        -------
        Tensor
            int64 slot mapping of the written tokens (``block * page_size + offset``).

        Raises
        ------
        KeyError
            An unknown sequence.
        ValueError
            Values of the wrong shape or not floating point, a sequence named twice, or as many
            ids as value tensors not given.
        CacheFullError
            Not enough free blocks for all of it.

        Whatever raises, the cache is left exactly as it was: every check, the encoding of the
        values (quantisation) and the slots are done before the write, and the sequences' blocks,
        lengths and the free list change only after it.
        """
        if isinstance(values, torch.Tensor):
            seq_ids, chunks = [seq_id], [values]
        else:
            seq_ids, chunks = list(seq_id), list(values)
            if len(seq_ids) != len(chunks):
                raise ValueError(f"{len(seq_ids)} sequence ids but {len(chunks)} value tensors")
        chunks = [self._normalise(v) for v in chunks]
        seqs = [self._get(s) for s in seq_ids]
        if len(set(map(id, seqs))) != len(seqs):
            raise ValueError("a sequence appears twice in one append; concatenate its values instead")
        # Capacity check for everything before touching anything.
        need = [max(0, math.ceil((s.length + v.shape[0]) / self.page_size) - len(s.blocks)) for s, v in zip(seqs, chunks)]
        if sum(need) > len(self._free):
            raise CacheFullError(f"append needs {sum(need)} free blocks of {self.page_size} tokens, "
                                 f"{len(self._free)} are free (capacity {self.num_blocks} blocks)")
        if not chunks:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        # Encoded per sequence (each may have its own float dtype), then the slots of the blocks pop() would hand out.
        encoded = torch.cat([self._encode(v) for v in chunks])
        taken = self._free[len(self._free) - sum(need):][::-1]
        new_blocks, slots = [], []
        for s, v, n in zip(seqs, chunks, need):
            blocks, taken = taken[:n], taken[n:]
            pos = torch.arange(s.length, s.length + v.shape[0])
            table = torch.tensor(s.blocks + blocks, dtype=torch.int64)
            slots.append(table[pos // self.page_size] * self.page_size + pos % self.page_size)
            new_blocks.append(blocks)
        slot_mapping = torch.cat(slots).to(self.device)
        self._write(slot_mapping, encoded)
        # The write is done: commit the bookkeeping (list operations, nothing below raises).
        del self._free[len(self._free) - sum(need):]
        for s, v, blocks in zip(seqs, chunks, new_blocks):
            s.blocks.extend(blocks)
            s.length += v.shape[0]
        return slot_mapping

    def write_slots(self, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
        """Write tokens at flat slots (vLLM ``concat_and_cache_mla``); slot -1 is skipped.

        Parameters
        ----------
        slot_mapping : Tensor
            int ``[n]``: ``block * page_size + offset`` per token, -1 to skip.
        values : Tensor
            ``[n, h_kv, D]`` (or ``[n, D]``), quantised on the way in.
        """
        values = self._normalise(values)
        slot_mapping = slot_mapping.to(self.device, torch.int64)
        if slot_mapping.shape != (values.shape[0],):
            raise ValueError(f"slot_mapping must be [{values.shape[0]}], got {list(slot_mapping.shape)}")
        cap = self.num_blocks * self.page_size
        if bool(((slot_mapping < -1) | (slot_mapping >= cap)).any()):
            raise ValueError(f"slot_mapping entries must be in [-1, {cap})")
        keep = slot_mapping >= 0
        slot_mapping, values = slot_mapping[keep], values[keep]
        self._write(slot_mapping, self._encode(values))

    def _write(self, slot_mapping: torch.Tensor, encoded: torch.Tensor) -> None:
        """Store encoded tokens (:meth:`_encode`) at flat slots."""
        if self.kv_format == "fp8_ds_v4":
            write_ds_v4(self.kv, slot_mapping, encoded)  # tokens are not rows of the tensor: write through the layout
        else:
            self._flat()[slot_mapping] = encoded

    def _flat(self) -> torch.Tensor:
        """The cache as ``[num_blocks * page_size, h_kv, last]`` token slots (a view)."""
        return self.kv.view(self.num_blocks * self.page_size, self.num_heads_kv, self.kv.shape[-1])

    def _encode(self, values: torch.Tensor) -> torch.Tensor:
        """Values as the cache stores them: cast or quantised (``fp8_ds_v4``: the fp32 values, quantised by the
        write, since its bytes are spread over the block)."""
        if self.kv_format in ("bf16", "fp16"):
            return values.to(self.kv.dtype)
        if self.kv_format == "fp8_e4m3":
            return quantize_fp8_e4m3(values, self.kv_scale)
        if self.kv_format == "fp8_ds_v4":
            return values.float()
        return pack_ds_mla(values)

    # -- reads -------------------------------------------------------------------------

    def decode_inputs(self, seq_ids: Sequence[Hashable], *, max_blocks: int | None = None,
                      pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_table int32 [B, max_blocks], cache_seqlens int32 [B])`` for ``seq_ids`` in order.

        Table entries past each sequence's blocks are ``pad_id`` (never read).
        """
        seqs = [self._get(s) for s in seq_ids]
        width = max([len(s.blocks) for s in seqs] + [1])
        if max_blocks is not None:
            if max_blocks < width:
                raise ValueError(f"max_blocks={max_blocks} is smaller than the longest sequence's {width} blocks")
            width = max_blocks
        table = torch.full((len(seqs), width), pad_id, dtype=torch.int32)
        for i, s in enumerate(seqs):
            table[i, : len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.int32)
        lens = torch.tensor([s.length for s in seqs], dtype=torch.int32)
        return table.to(self.device), lens.to(self.device)

    def gather(self, seq_id: Hashable) -> torch.Tensor:
        """fp32 ``[L, h_kv, D]``: a sequence's tokens, dequantised (for checks)."""
        s = self._get(seq_id)
        pos = torch.arange(s.length)
        blocks = torch.tensor(s.blocks, dtype=torch.int64)[pos // self.page_size] if s.length else pos
        return gather_tokens(self.kv, blocks.to(self.device), (pos % self.page_size).to(self.device), self.kv_format,
                             self.kv_scale)
