"""What dropped plans leave for the next plans: one pool, keyed by what makes an object reusable.

A plan made per decode step allocates objects the next step's plan could take over (the split-KV plan's buffers,
:mod:`.split_plan`; FlashInfer's wrapper, whose construction allocates a pinned host buffer,
``backends/flashinfer.py``). A plan gives its objects back when it is collected and the next plan of the same key
takes them instead of making new ones. The key holds the stream current when the plan was made (:func:`stream_of`):
the next plan's work is ordered after the dropped plan's last kernels only on that stream (a plan run on another
stream than it was made on is the caller's to order, as with any plan's buffers). The lock is re-entrant: a
collection while it is held may drop a plan, whose finaliser gives back.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

__all__ = ["ReusePool", "reuse_key", "stream_of"]


def stream_of(device: torch.device) -> int:
    """The handle of ``device``'s current stream (0 off CUDA): the part of a pool key that orders reuse."""
    if device.type != "cuda":
        return 0
    # the raw handle without a Stream object (torch.cuda.current_stream builds one: a few µs on a plan's host path)
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device() if device.index is None else device.index)


def reuse_key(device: torch.device, *what) -> tuple | None:
    """``(*what, device, stream)``: the key objects made now for ``device`` are pooled under (the device named by its
    index, its current stream: :func:`stream_of`); None, pool nothing, while that stream captures a CUDA graph: what
    is allocated in a capture belongs to the graph's memory pool and its replays may write it, so it must not outlive
    its plan in another plan's hands, and a plan captured with pooled objects must not give them on."""
    if device.type != "cuda":
        return (*what, device, 0)
    if torch.cuda.is_current_stream_capturing():
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return (*what, device, stream_of(device))


class ReusePool:
    """Objects given back by dropped plans, by key: at most ``keep`` per key and, where ``size`` is given (an
    object's bytes), at most ``max_bytes`` in all, the oldest given back leaving first (to the allocator)."""

    def __init__(self, keep: int, *, max_bytes: int | None = None, size: Callable[[Any], int] | None = None) -> None:
        if (max_bytes is None) != (size is None):
            raise ValueError("max_bytes and size go together")
        self.keep = keep
        self.max_bytes = max_bytes
        self._size = size
        self._free: dict[tuple, list] = {}  # insertion order: the oldest key first
        self._bytes = 0
        self._lock = threading.RLock()

    def take(self, key: tuple):
        """An object given back under ``key``, or None."""
        with self._lock:
            free = self._free.get(key)
            if not free:
                return None
            obj = free.pop()
            if not free:
                del self._free[key]
            if self._size is not None:
                self._bytes -= self._size(obj)
            return obj

    def give(self, key: tuple, obj) -> None:
        """Keep ``obj`` for the next :meth:`take` of ``key`` (or drop it: ``keep`` reached, or over the budget)."""
        size = 0 if self._size is None else self._size(obj)
        with self._lock:
            free = self._free.get(key, [])
            if len(free) >= self.keep or (self.max_bytes is not None and size > self.max_bytes):
                return
            free.append(obj)
            self._free[key] = free
            self._bytes += size
            while self.max_bytes is not None and self._bytes > self.max_bytes:  # the oldest key's objects go first
                oldest = next(iter(self._free))
                self._bytes -= self._size(self._free[oldest].pop(0))
                if not self._free[oldest]:
                    del self._free[oldest]

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._bytes = 0

    @property
    def pooled_bytes(self) -> int:
        return self._bytes
