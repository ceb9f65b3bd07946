"""KV-cache storage formats: what a cached token looks like in memory.

``"bf16"`` / ``"fp16"``
    ``D_qk`` values of the query dtype per token and KV head.
``"fp8_e4m3"``
    ``D_qk`` ``float8_e4m3fn`` values per token, one fp32 scale for the whole
    tensor (``kv_scale``): ``value = stored * kv_scale``.
``"fp8_ds_mla"``
    DeepSeek's 656-byte token (FlashMLA README "FP8 with scale", DeepSeek-V3.2):
    bytes ``[0, 512)`` the 512 NoPE values as ``float8_e4m3fn``, bytes
    ``[512, 528)`` four fp32 scales (one per 128 NoPE values), bytes
    ``[528, 656)`` the 64 RoPE values in bf16, unquantised. Scales are powers of
    two: ``scale = 2 ** ceil(log2(max(amax / 448, 1e-4)))`` (FlashMLA
    ``tests/quant.py``). The cache tensor is ``uint8 [..., 656]``; only
    ``D_qk = 576``, ``D_v = 512`` is defined.
"""

from __future__ import annotations

import torch

__all__ = [
    "KV_FORMATS",
    "KV_FORMAT_CODES",
    "DS_MLA_TOKEN_BYTES",
    "storage_dtype",
    "quantize_fp8_e4m3",
    "dequantize_fp8_e4m3",
    "pack_ds_mla",
    "unpack_ds_mla",
    "dequantize_tokens",
]

KV_FORMATS = ("bf16", "fp16", "fp8_e4m3", "fp8_ds_mla")
#: The integer every kernel takes for a format (the Triton kernels' ``KV_FORMAT`` constexpr, the CUDA family's
#: ``KvFormat`` in kernels/cuda/mla_decode_sm90/config.h): a 16-bit cache is "the query's dtype", 0 for both.
KV_FORMAT_CODES = {"bf16": 0, "fp16": 0, "fp8_e4m3": 1, "fp8_ds_mla": 2}
FP8_MAX = 448.0

DS_MLA_NOPE = 512
DS_MLA_ROPE = 64
DS_MLA_TILE = 128
DS_MLA_SCALES = DS_MLA_NOPE // DS_MLA_TILE  # 4
DS_MLA_SCALE_OFFSET = DS_MLA_NOPE  # bytes
DS_MLA_ROPE_OFFSET = DS_MLA_NOPE + 4 * DS_MLA_SCALES  # 528
DS_MLA_TOKEN_BYTES = DS_MLA_ROPE_OFFSET + 2 * DS_MLA_ROPE  # 656

_DTYPE_OF_FORMAT = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_ds_mla": torch.uint8,
}


def storage_dtype(kv_format: str) -> torch.dtype:
    """The torch dtype of a cache tensor in ``kv_format``."""
    return _DTYPE_OF_FORMAT[kv_format]


def format_of_dtype(dtype: torch.dtype) -> str | None:
    """The unique format a cache of this dtype can hold (``None`` if unknown)."""
    for name, dt in _DTYPE_OF_FORMAT.items():
        if dt == dtype:
            return name
    if dtype == torch.int8:  # FlashMLA accepts int8 views of the 656-byte token too
        return "fp8_ds_mla"
    return None


def quantize_fp8_e4m3(x: torch.Tensor, kv_scale: float | torch.Tensor) -> torch.Tensor:
    """``x / kv_scale`` saturated to ±448 and cast to ``float8_e4m3fn``."""
    scale = torch.as_tensor(kv_scale, dtype=torch.float32, device=x.device)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8_e4m3(x: torch.Tensor, kv_scale: float | torch.Tensor) -> torch.Tensor:
    """fp32 ``x * kv_scale``."""
    scale = torch.as_tensor(kv_scale, dtype=torch.float32, device=x.device)
    return x.float() * scale


def pack_ds_mla(x: torch.Tensor) -> torch.Tensor:
    """Quantise ``[..., 576]`` values into the 656-byte ``fp8_ds_mla`` token, ``uint8 [..., 656]``."""
    if x.shape[-1] != DS_MLA_NOPE + DS_MLA_ROPE:
        raise ValueError(f"fp8_ds_mla packs tokens of 576 values, got last dim {x.shape[-1]}")
    lead = x.shape[:-1]
    nope = x[..., :DS_MLA_NOPE].float().reshape(*lead, DS_MLA_SCALES, DS_MLA_TILE)
    amax = nope.abs().amax(dim=-1)
    scale = torch.exp2(torch.ceil(torch.log2((amax / FP8_MAX).clamp_min(1e-4))))
    q = (nope / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = torch.empty(*lead, DS_MLA_TOKEN_BYTES, dtype=torch.uint8, device=x.device)
    out[..., :DS_MLA_NOPE] = q.reshape(*lead, DS_MLA_NOPE).view(torch.uint8)
    out[..., DS_MLA_SCALE_OFFSET:DS_MLA_ROPE_OFFSET] = scale.to(torch.float32).contiguous().view(torch.uint8)
    out[..., DS_MLA_ROPE_OFFSET:] = x[..., DS_MLA_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def unpack_ds_mla(packed: torch.Tensor) -> torch.Tensor:
    """Dequantise ``[..., 656]`` bytes into fp32 ``[..., 576]``."""
    if packed.shape[-1] != DS_MLA_TOKEN_BYTES:
        raise ValueError(f"fp8_ds_mla tokens are {DS_MLA_TOKEN_BYTES} bytes, got last dim {packed.shape[-1]}")
    packed = packed.contiguous().view(torch.uint8)
    lead = packed.shape[:-1]
    nope = packed[..., :DS_MLA_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    scale = packed[..., DS_MLA_SCALE_OFFSET:DS_MLA_ROPE_OFFSET].contiguous().view(torch.float32)
    nope = (nope.reshape(*lead, DS_MLA_SCALES, DS_MLA_TILE) * scale[..., None]).reshape(*lead, DS_MLA_NOPE)
    rope = packed[..., DS_MLA_ROPE_OFFSET:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=-1)


def dequantize_tokens(tokens: torch.Tensor, kv_format: str, kv_scale: torch.Tensor | float | None) -> torch.Tensor:
    """fp32 values of cached tokens ``[..., D]`` (or ``[..., 656]`` bytes) in ``kv_format``."""
    if kv_format in ("bf16", "fp16"):
        return tokens.float()
    if kv_format == "fp8_e4m3":
        return dequantize_fp8_e4m3(tokens, kv_scale)
    if kv_format == "fp8_ds_mla":
        return unpack_ds_mla(tokens)
    raise ValueError(f"kv_format={kv_format!r} (supported: {', '.join(KV_FORMATS)})")
