"""The device guard every Triton launch runs under."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["kernel_device"]


def kernel_device(t: torch.Tensor):
    """A context in which a kernel launched on the *current* CUDA device runs on ``t``'s GPU.

    Triton launches on the current device whatever device its tensor arguments are on: with
    tensors on ``cuda:1`` while ``cuda:0`` is current, triton 3.6 refuses the launch ("Pointer
    argument ... cannot be accessed from Triton"). Returns ``torch.cuda.device(t.device)`` for a
    CUDA tensor and a no-op context otherwise (CPU tensors under Triton's interpreter).
    """
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()
