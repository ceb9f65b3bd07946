"""sgl-flash-mla's MegaAttention (``flash_mla.fused_norm_rope_attn_rope_cast``): named, not provided.

sgl-flash-mla 1.0.0 ships a fused DeepSeek-V4 attention step, q RMS-norm, RoPE, sparse attention, inverse RoPE and
an fp8 cast in one kernel, as the submodule ``fused_norm_rope_attn_rope_cast`` with ``prefill`` and ``decode``.
SGLang 0.5.23 imports it at module load (``sglang/kernels/ops/attention/flash_mla_interface.py``) and calls it only
with ``--dsv4-attn-backend flashmla_mega``; its default DeepSeek-V4 path calls ``flash_mla_with_kvcache``. This
namespace lets that import succeed under the alias; calling either function raises ``NotImplementedError`` saying
what to use instead.
"""

from __future__ import annotations

import types

__all__ = ["fused_norm_rope_attn_rope_cast"]

_WHY = ("sgl-flash-mla's MegaAttention (fused_norm_rope_attn_rope_cast.{name}: q norm, RoPE, sparse attention, "
        "inverse RoPE and fp8 cast in one kernel) is not provided by mla_dispatch; SGLang calls it only with "
        "--dsv4-attn-backend flashmla_mega: leave that option at its default, whose decode calls "
        "flash_mla_with_kvcache")


def _not_provided(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(_WHY.format(name=name))

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"Not provided: raises NotImplementedError ({_WHY.format(name=name)})."
    return call


fused_norm_rope_attn_rope_cast = types.ModuleType(
    "flash_mla.fused_norm_rope_attn_rope_cast", "sgl-flash-mla's MegaAttention: not provided by mla_dispatch")
fused_norm_rope_attn_rope_cast.prefill = _not_provided("prefill")
fused_norm_rope_attn_rope_cast.decode = _not_provided("decode")
