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
import threading
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
        Capacity is ``num_blocks * page_size`` tokens; each >= 1.
    head_dim : int
        ``D_qk`` values per token (DeepSeek: 576); >= 1.
    num_heads_kv : int
        KV heads (DeepSeek: 1); >= 1.
    kv_format : {"bf16", "fp16", "fp8_e4m3", "fp8_ds_mla", "fp8_ds_v4"}
        ``"fp8_ds_v4"`` (DeepSeek-V4) needs ``head_dim=512`` and one KV head.
    kv_scale : float, optional
        Per-tensor scale for ``"fp8_e4m3"``, required there, finite and positive (values saturate at
        ``±448 * kv_scale``); None for the other formats.
    device : str or torch.device

    Raises
    ------
    ValueError
        A size that is not an int >= 1, an unknown ``kv_format``, a ``kv_scale`` missing, not finite or not
        positive for ``"fp8_e4m3"`` or given for another format, ``"fp8_ds_mla"`` with another head_dim or
        num_heads_kv than 576 and 1.

    Attributes
    ----------
    kv : Tensor
        ``[num_blocks, page_size, num_heads_kv, head_dim]`` (``uint8 [..., 656]`` for
        ``"fp8_ds_mla"``; for ``"fp8_ds_v4"`` ``uint8 [num_blocks, page_size, 1, 584]``, a view of
        blocks padded to a multiple of 576 bytes, FlashMLA's layout); pass the cache object (or this
        tensor) to ``mla_decode``.

    Threads
    -------
    Every method may be called from several threads at once. One lock covers the bookkeeping (the free list,
    each sequence's blocks and length): :meth:`append` takes its blocks, writes its tokens and commits under
    it, so concurrent appends (to different sequences or the same one) never share a block, never lose one, and
    never write into another sequence's slots; :meth:`add_sequence` and :meth:`free` change the bookkeeping under
    it; :meth:`decode_inputs`, :meth:`gather`, :meth:`seq_len`, ``len()``, ``in`` and :attr:`num_free_blocks`
    read it under it, so each sees the state between whole calls. What the lock does not cover, and stays the
    caller's to order:

    - a block table from :meth:`decode_inputs` is a snapshot: freeing a sequence hands its blocks to the next
      append, so free it only after every decode that reads its table has run (on a GPU: after the stream work
      that reads it, not only after the Python call returned);
    - the lock orders the calls on the host; the writes themselves are queued on the calling thread's current
      CUDA stream, and a decode on another stream must wait for them (an event), as with any tensor;
    - :meth:`write_slots` writes the slots it is given without consulting the bookkeeping, and the :attr:`kv`
      tensor read or written directly is outside the lock;
    - one process: the cache is not shared between processes.

    Examples
    --------
    >>> cache = PagedMLACache(num_blocks=8, page_size=16)
    >>> cache.add_sequence("a")
    >>> cache.append("a", torch.randn(20, 576))
    >>> table, lens = cache.decode_inputs(["a"])
    """

    def __init__(self, num_blocks: int, page_size: int, *, head_dim: int = 576, num_heads_kv: int = 1,
                 kv_format: str = "bf16", kv_scale: float | None = None, device: str | torch.device = "cpu"):
        for name, value in (("num_blocks", num_blocks), ("page_size", page_size), ("head_dim", head_dim),
                            ("num_heads_kv", num_heads_kv)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
        if kv_format == "fp8_e4m3":
            # inf or NaN would decode every token to NaN (and 0 or less is no scale): refuse them here
            if isinstance(kv_scale, bool) or not isinstance(kv_scale, (int, float)) or not (
                    math.isfinite(kv_scale) and kv_scale > 0):
                raise ValueError(f"kv_format='fp8_e4m3' needs a positive kv_scale, a finite float, got {kv_scale!r}")
        elif kv_scale is not None:
            raise ValueError(f"kv_scale is only used with kv_format='fp8_e4m3' (its per-tensor scale), got "
                             f"kv_scale={kv_scale!r} with kv_format={kv_format!r}: pass kv_scale=None")
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
        # Guards _free and _seqs (the sequences' blocks and lengths): see the class docstring, "Threads".
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """copy / pickle: the bookkeeping as it is between calls, without the lock (a copy gets its own)."""
        with self._lock:
            state = {k: v for k, v in self.__dict__.items() if k != "_lock"}
            state["_free"] = list(self._free)
            state["_seqs"] = {k: _Sequence(list(s.blocks), s.length) for k, s in self._seqs.items()}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- bookkeeping -----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        with self._lock:
            return len(self._free)

    def __contains__(self, seq_id: Hashable) -> bool:
        with self._lock:
            return seq_id in self._seqs

    def __len__(self) -> int:
        with self._lock:
            return len(self._seqs)

    def seq_len(self, seq_id: Hashable) -> int:
        with self._lock:
            return self._get(seq_id).length

    def _get(self, seq_id: Hashable) -> _Sequence:
        """The sequence's record; call with the lock held."""
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r} (known: {list(self._seqs)[:8]})") from None

    def _snapshot(self, seq_id: Hashable) -> tuple[list[int], int]:
        """A copy of a sequence's blocks and its length, taken under the lock."""
        with self._lock:
            seq = self._get(seq_id)
            return list(seq.blocks), seq.length

    def add_sequence(self, seq_id: Hashable) -> None:
        """Start an empty sequence. Raises ValueError if ``seq_id`` exists."""
        with self._lock:
            if seq_id in self._seqs:
                raise ValueError(f"sequence {seq_id!r} already exists")
            self._seqs[seq_id] = _Sequence(blocks=[], length=0)

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence and return its blocks to the allocator (the next appends may reuse them at once: see
        "Threads" in the class docstring)."""
        with self._lock:
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
        # the cache stores values, not a graph: values that require grad must not make cache.kv an autograd node
        return values.detach().to(self.device)

    def append(self, seq_id: Hashable | Sequence[Hashable], values: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """Append tokens to one sequence, or to several at once (all or nothing).

        Parameters
        ----------
        seq_id : hashable or sequence of hashables
            One id with one tensor; a list (or tuple) of ids with a list of tensors.
        values : Tensor or sequence of Tensors
            ``[n, h_kv, D]`` (or ``[n, D]``) per sequence, any float dtype. Stored as values: a tensor
            that requires grad is detached (the cache never joins an autograd graph).

        Returns
        -------
        Tensor
            int64 slot mapping of the written tokens (``block * page_size + offset``).

        Raises
        ------
        KeyError
            An unknown sequence.
        ValueError
            Values of the wrong shape or not floating point, a sequence named twice, as many
            ids as value tensors not given, or list values with a ``seq_id`` that is not a list
            or tuple of ids (a string is one id).
        CacheFullError
            Not enough free blocks for all of it.

        Whatever raises, the cache is left exactly as it was: every check, the encoding of the
        values (quantisation) and the slots are done before the write, and the sequences' blocks,
        lengths and the free list change only after it. The values are encoded before the lock is
        taken; the checks against the bookkeeping, the choice of blocks, the write and the commit
        happen under it, as one step for every other thread.
        """
        if isinstance(values, torch.Tensor):
            seq_ids, chunks = [seq_id], [values]
        else:
            if isinstance(seq_id, (str, bytes)) or not isinstance(seq_id, Sequence):
                # "ab" would otherwise name the sequences "a" and "b"
                raise ValueError(f"seq_id must be a list of sequence ids when values is a list of tensors, got "
                                 f"{seq_id!r} (for one sequence pass one tensor: torch.cat its values)")
            seq_ids, chunks = list(seq_id), list(values)
            if len(seq_ids) != len(chunks):
                raise ValueError(f"{len(seq_ids)} sequence ids but {len(chunks)} value tensors")
        chunks = [self._normalise(v) for v in chunks]
        if not chunks:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        # Encoded per sequence (each may have its own float dtype), outside the lock: it reads no bookkeeping.
        encoded = torch.cat([self._encode(v) for v in chunks])
        with self._lock:
            return self._append_locked(seq_ids, chunks, encoded)

    def _append_locked(self, seq_ids: list, chunks: list[torch.Tensor], encoded: torch.Tensor) -> torch.Tensor:
        """:meth:`append`'s checks against the bookkeeping, write and commit; call with the lock held."""
        seqs = [self._get(s) for s in seq_ids]
        if len(set(map(id, seqs))) != len(seqs):
            raise ValueError("a sequence appears twice in one append; concatenate its values instead")
        # Capacity check for everything before touching anything.
        need = [max(0, math.ceil((s.length + v.shape[0]) / self.page_size) - len(s.blocks)) for s, v in zip(seqs, chunks)]
        if sum(need) > len(self._free):
            raise CacheFullError(f"append needs {sum(need)} free blocks of {self.page_size} tokens, "
                                 f"{len(self._free)} are free (capacity {self.num_blocks} blocks)")
        # The slots of the blocks pop() would hand out.
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

        The slots are the caller's: they are not checked against the sequences' blocks (and not taken under the
        bookkeeping lock).

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
        with self._lock:  # one consistent snapshot of every sequence asked for
            seqs = [_Sequence(list(s.blocks), s.length) for s in (self._get(i) for i in seq_ids)]
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
        seq_blocks, length = self._snapshot(seq_id)
        pos = torch.arange(length)
        blocks = torch.tensor(seq_blocks, dtype=torch.int64)[pos // self.page_size] if length else pos
        return gather_tokens(self.kv, blocks.to(self.device), (pos % self.page_size).to(self.device), self.kv_format,
                             self.kv_scale)
