"""The registered op ``mla_dispatch::amla_decode``: schema, fake, and the emulation on CPU/CUDA.

The schema and the fake (meta) implementation live here, in Python, so the op
exists and shape-checks everywhere (torch.compile, ``opcheck``). The CPU and
CUDA kernels are the bit-faithful emulation
(:mod:`mla_dispatch.kernels.ascend.amla_emulation`); the NPU kernel
(``PrivateUse1``) is registered by the C++ extension built from
``kernels/ascend`` (``host/torch_binding.cpp``, ``TORCH_LIBRARY_IMPL(mla_dispatch,
PrivateUse1, m)``), which :func:`load_npu_extension` loads when it exists.

Schema::

    amla_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor cache_seqlens,
                int[] seqlens_host, Tensor(a!) out, Tensor(b!) lse,
                float softmax_scale, bool causal, int num_cores) -> ()

``seqlens_host`` are the request lengths as a host list (the Ascend host
tiling partitions work from them, as torch_npu's ``actual_seq_kvlen`` does);
they must equal ``cache_seqlens``.
"""

from __future__ import annotations

import glob
import os

import torch

__all__ = ["OP_NAME", "load_npu_extension", "npu_kernel_registered"]

OP_NAME = "mla_dispatch::amla_decode"
_SCHEMA = (
    "amla_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor cache_seqlens, int[] seqlens_host, "
    "Tensor(a!) out, Tensor(b!) lse, float softmax_scale, bool causal, int num_cores) -> ()"
)

_lib = torch.library.Library("mla_dispatch", "FRAGMENT")  # owns the op's definition in this process
_lib.define(_SCHEMA)


def _emulated(q, kv_cache, block_table, cache_seqlens, seqlens_host, out, lse, softmax_scale, causal, num_cores):
    from mla_dispatch.kernels.ascend.amla_emulation import amla_decode

    o, l = amla_decode(q, kv_cache, block_table, cache_seqlens, head_dim_v=out.shape[-1],
                       softmax_scale=softmax_scale, causal=causal, num_cores=num_cores)
    out.copy_(o)
    lse.copy_(l)


_lib.impl("amla_decode", _emulated, "CPU")
_lib.impl("amla_decode", _emulated, "CUDA")


@torch.library.register_fake(OP_NAME)
def _(q, kv_cache, block_table, cache_seqlens, seqlens_host, out, lse, softmax_scale, causal, num_cores) -> None:
    return None


_EXTENSION_GLOB = "_amla_npu*.so"
_loaded: list[str] = []


def load_npu_extension() -> str | None:
    """Load the built NPU extension (``libamla_torch``/``_amla_npu*.so`` next to this file
    or named by ``MLA_DISPATCH_AMLA_LIB``). Returns an error text, or None when loaded."""
    if _loaded:
        return None
    candidates = [os.environ["MLA_DISPATCH_AMLA_LIB"]] if os.environ.get("MLA_DISPATCH_AMLA_LIB") else []
    candidates += sorted(glob.glob(os.path.join(os.path.dirname(__file__), _EXTENSION_GLOB)))
    if not candidates:
        return ("our Ascend C kernel is not built (no kernels/ascend/_amla_npu*.so; build it with CANN: "
                "see mla_dispatch/kernels/ascend/NOTES.md)")
    try:
        torch.ops.load_library(candidates[0])
    except Exception as exc:
        return f"loading {candidates[0]} failed: {type(exc).__name__}: {exc}"
    _loaded.append(candidates[0])
    return None


def npu_kernel_registered() -> bool:
    """Whether a PrivateUse1 (NPU) kernel is registered for ``mla_dispatch::amla_decode``."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(OP_NAME, "PrivateUse1")
