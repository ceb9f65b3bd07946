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
``"fp8_ds_v4"``
    DeepSeek-V4's cache (FlashMLA's "MODEL1", ``tests/quant.py``
    ``FP8KVCacheLayout.MODEL1_FP8Sparse``; sgl-flash-mla's ``kv_format="V4"``), laid out per *block*, not per
    token. A token is 512 values: 448 NoPE values quantised to ``float8_e4m3fn`` in 7 tiles of 64, each with a
    power-of-two scale stored as one ue8m0 byte (``2 ** (byte - 127)``, chosen as above), and 64 RoPE values in
    bf16, unquantised; V is the whole token (``D_qk = D_v = 512``: the RoPE channels are attended to and
    summed into the output like the others). A block of ``page_size`` tokens holds first, token after token,
    each token's 448 fp8 bytes then its 128 RoPE bytes (576 bytes a token), then each token's 7 scale bytes and
    one pad byte (8 a token): 584 bytes a token, the block padded to a multiple of 576 bytes. The cache
    tensor is ``uint8 [num_blocks, page_size, 1, 584]`` whose dim 1 has stride 584 and dim 0 any stride of at
    least ``page_size * 584`` (FlashMLA's own cache is a view with the padded block size as stride); its
    "rows" of 584 bytes are not tokens, so tokens are read through :func:`gather_tokens`, never by indexing the
    tensor. One KV head only.
"""

from __future__ import annotations

import torch

__all__ = [
    "KV_FORMATS",
    "KV_FORMAT_CODES",
    "DS_MLA_TOKEN_BYTES",
    "DS_V4_TOKEN_BYTES",
    "storage_dtype",
    "quantize_fp8_e4m3",
    "dequantize_fp8_e4m3",
    "pack_ds_mla",
    "unpack_ds_mla",
    "dequantize_tokens",
    "ds_v4_block_bytes",
    "empty_ds_v4_cache",
    "pack_ds_v4",
    "unpack_ds_v4",
    "write_ds_v4",
    "check_ds_v4_cache",
    "gather_tokens",
    "token_bytes",
]

KV_FORMATS = ("bf16", "fp16", "fp8_e4m3", "fp8_ds_mla", "fp8_ds_v4")
#: The integer every kernel takes for a format (the Triton kernels' ``KV_FORMAT`` constexpr, the CUDA family's
#: ``KvFormat`` in kernels/cuda/mla_decode_sm90/config.h): a 16-bit cache is "the query's dtype", 0 for both.
KV_FORMAT_CODES = {"bf16": 0, "fp16": 0, "fp8_e4m3": 1, "fp8_ds_mla": 2, "fp8_ds_v4": 3}
FP8_MAX = 448.0

DS_MLA_NOPE = 512
DS_MLA_ROPE = 64
DS_MLA_TILE = 128
DS_MLA_SCALES = DS_MLA_NOPE // DS_MLA_TILE  # 4
DS_MLA_SCALE_OFFSET = DS_MLA_NOPE  # bytes
DS_MLA_ROPE_OFFSET = DS_MLA_NOPE + 4 * DS_MLA_SCALES  # 528
DS_MLA_TOKEN_BYTES = DS_MLA_ROPE_OFFSET + 2 * DS_MLA_ROPE  # 656

DS_V4_NOPE = 448
DS_V4_ROPE = 64
DS_V4_DIM = DS_V4_NOPE + DS_V4_ROPE  # 512: D_qk and D_v
DS_V4_TILE = 64
DS_V4_SCALES = DS_V4_NOPE // DS_V4_TILE  # 7
DS_V4_DATA_BYTES = DS_V4_NOPE + 2 * DS_V4_ROPE  # 576: a token's fp8 NoPE and bf16 RoPE, at token * 576 in its block
DS_V4_SCALE_BYTES = DS_V4_SCALES + 1  # 8: a token's ue8m0 scales and a pad byte, at page_size * 576 + token * 8
DS_V4_TOKEN_BYTES = DS_V4_DATA_BYTES + DS_V4_SCALE_BYTES  # 584
DS_V4_BLOCK_ALIGN = 576  # a block's bytes are padded to a multiple of this (FlashMLA tests/quant.py)

_DTYPE_OF_FORMAT = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_ds_mla": torch.uint8,
    "fp8_ds_v4": torch.uint8,
}

#: the quantised formats whose cache tensor is bytes, and how many bytes a token takes there
_TOKEN_BYTES = {"fp8_ds_mla": DS_MLA_TOKEN_BYTES, "fp8_ds_v4": DS_V4_TOKEN_BYTES}


def storage_dtype(kv_format: str) -> torch.dtype:
    """The torch dtype of a cache tensor in ``kv_format``."""
    return _DTYPE_OF_FORMAT[kv_format]


def token_bytes(kv_format: str) -> int | None:
    """Bytes per token of a byte-packed format (``fp8_ds_mla``: 656, ``fp8_ds_v4``: 584), else None."""
    return _TOKEN_BYTES.get(kv_format)


def format_of_dtype(dtype: torch.dtype, last_dim: int | None = None) -> str | None:
    """The format a cache of this dtype (and last dim, for byte caches) holds (``None`` if unknown).

    A byte cache (``uint8``, or ``int8``: FlashMLA accepts int8 views too) is ``fp8_ds_v4`` when its last dim is
    584, else ``fp8_ds_mla``.
    """
    if dtype in (torch.uint8, torch.int8):
        return "fp8_ds_v4" if last_dim == DS_V4_TOKEN_BYTES else "fp8_ds_mla"
    for name, dt in _DTYPE_OF_FORMAT.items():
        if dt == dtype:
            return name
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
    """fp32 values of cached tokens ``[..., D]`` (or ``[..., 656]`` bytes) in ``kv_format``.

    Not for ``fp8_ds_v4``, whose tokens are not rows of the cache tensor: use :func:`gather_tokens`.
    """
    if kv_format in ("bf16", "fp16"):
        return tokens.float()
    if kv_format == "fp8_e4m3":
        return dequantize_fp8_e4m3(tokens, kv_scale)
    if kv_format == "fp8_ds_mla":
        return unpack_ds_mla(tokens)
    if kv_format == "fp8_ds_v4":
        raise ValueError("kv_format='fp8_ds_v4' is laid out per block: read its tokens with gather_tokens()")
    raise ValueError(f"kv_format={kv_format!r} (supported: {', '.join(KV_FORMATS)})")


def gather_tokens(kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, kv_format: str,
                  kv_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """fp32 values ``[..., h_kv, D]`` of the tokens at ``(blocks, offsets)`` (int64, same shape) of a 4-D
    ``kv_cache`` ``[num_blocks, page_size, h_kv, D or bytes]`` in ``kv_format``. Every id must be in range."""
    if kv_format == "fp8_ds_v4":
        data, scales = _ds_v4_views(kv_cache)
        return _decode_ds_v4(data[blocks, offsets], scales[blocks, offsets]).unsqueeze(-2)
    return dequantize_tokens(kv_cache[blocks, offsets], kv_format, kv_scale)


# -- fp8_ds_v4 (DeepSeek-V4, FlashMLA's MODEL1) ---------------------------------------------------------------------


def ds_v4_block_bytes(page_size: int) -> int:
    """Bytes of one ``fp8_ds_v4`` block of ``page_size`` tokens, padded to a multiple of 576."""
    return -(-page_size * DS_V4_TOKEN_BYTES // DS_V4_BLOCK_ALIGN) * DS_V4_BLOCK_ALIGN


def empty_ds_v4_cache(num_blocks: int, page_size: int, *, device: str | torch.device = "cpu",
                      fill: int | None = 0) -> torch.Tensor:
    """A new ``fp8_ds_v4`` cache: ``uint8 [num_blocks, page_size, 1, 584]``, a view of ``[num_blocks, padded block
    bytes]`` (:func:`ds_v4_block_bytes`), every byte ``fill`` (None: left uninitialised)."""
    stride = ds_v4_block_bytes(page_size)
    make = torch.empty if fill is None else torch.full
    args = () if fill is None else (fill,)
    raw = make((num_blocks, stride), *args, dtype=torch.uint8, device=device)
    return raw[:, : page_size * DS_V4_TOKEN_BYTES].view(num_blocks, page_size, 1, DS_V4_TOKEN_BYTES)


def check_ds_v4_cache(kv_cache: torch.Tensor, name: str = "kv_cache") -> None:
    """Raise ValueError unless ``kv_cache`` is a 4-D ``fp8_ds_v4`` cache: ``[num_blocks, page_size, 1, 584]``
    of 1-byte elements, dim 1 of stride 584, blocks ``>= page_size * 584`` bytes apart."""
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.shape[3] != DS_V4_TOKEN_BYTES:
        raise ValueError(f"{name} must be [num_blocks, page_size, 1, {DS_V4_TOKEN_BYTES}] for kv_format='fp8_ds_v4' "
                         f"(one KV head), got shape {list(kv_cache.shape)}")
    if kv_cache.element_size() != 1:
        raise ValueError(f"{name} must hold bytes (uint8) for kv_format='fp8_ds_v4', got {kv_cache.dtype}")
    page_size = kv_cache.shape[1]
    if kv_cache.stride(3) != 1 or (page_size > 1 and kv_cache.stride(1) != DS_V4_TOKEN_BYTES):
        raise ValueError(f"{name} must keep each block contiguous for kv_format='fp8_ds_v4': strides [*, "
                         f"{DS_V4_TOKEN_BYTES}, *, 1], got {list(kv_cache.stride())}")
    if kv_cache.shape[0] > 1 and kv_cache.stride(0) < page_size * DS_V4_TOKEN_BYTES:
        raise ValueError(f"{name}.stride(0) must be at least page_size * {DS_V4_TOKEN_BYTES} = "
                         f"{page_size * DS_V4_TOKEN_BYTES} bytes for kv_format='fp8_ds_v4', got {kv_cache.stride(0)}")


def _ds_v4_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data uint8 [num_blocks, page_size, 576], scales uint8 [num_blocks, page_size, 8])``: views of a 4-D
    ``fp8_ds_v4`` cache's per-token bytes (NoPE and RoPE; scales and pad) in the same storage."""
    num_blocks, page_size = kv_cache.shape[:2]
    kv = kv_cache.view(torch.uint8) if kv_cache.dtype != torch.uint8 else kv_cache
    s0, off = kv.stride(0), kv.storage_offset()
    data = kv.as_strided((num_blocks, page_size, DS_V4_DATA_BYTES), (s0, DS_V4_DATA_BYTES, 1), off)
    scales = kv.as_strided((num_blocks, page_size, DS_V4_SCALE_BYTES), (s0, DS_V4_SCALE_BYTES, 1),
                           off + page_size * DS_V4_DATA_BYTES)
    return data, scales


def _encode_ds_v4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., 512]`` values -> ``(data uint8 [..., 576], scales uint8 [..., 8])`` (FlashMLA tests/quant.py)."""
    if x.shape[-1] != DS_V4_DIM:
        raise ValueError(f"fp8_ds_v4 packs tokens of {DS_V4_DIM} values, got last dim {x.shape[-1]}")
    lead = x.shape[:-1]
    nope = x[..., :DS_V4_NOPE].float().reshape(*lead, DS_V4_SCALES, DS_V4_TILE)
    amax = nope.abs().amax(dim=-1)
    exponent = torch.ceil(torch.log2((amax / FP8_MAX).clamp_min(1e-4)))  # NaN stays NaN
    scale = torch.exp2(exponent)
    q = (nope / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    data = torch.empty(*lead, DS_V4_DATA_BYTES, dtype=torch.uint8, device=x.device)
    data[..., :DS_V4_NOPE] = q.reshape(*lead, DS_V4_NOPE).view(torch.uint8)
    data[..., DS_V4_NOPE:] = x[..., DS_V4_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    scales = torch.zeros(*lead, DS_V4_SCALE_BYTES, dtype=torch.uint8, device=x.device)
    biased = torch.where(torch.isnan(exponent), torch.full_like(exponent, 255), (exponent + 127).clamp(0, 254))
    scales[..., :DS_V4_SCALES] = biased.to(torch.uint8)
    return data, scales


def _decode_ds_v4(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., 512]`` of tokens given as ``data [..., 576]`` and ``scales [..., 8]`` bytes."""
    lead = data.shape[:-1]
    nope = data[..., :DS_V4_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    scale = scales[..., :DS_V4_SCALES].contiguous().view(torch.float8_e8m0fnu).float()  # 2 ** (byte - 127); 255: NaN
    nope = (nope.reshape(*lead, DS_V4_SCALES, DS_V4_TILE) * scale[..., None]).reshape(*lead, DS_V4_NOPE)
    rope = data[..., DS_V4_NOPE:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=-1)


def pack_ds_v4(x: torch.Tensor) -> torch.Tensor:
    """Quantise ``[num_blocks, page_size, 512]`` (or ``[num_blocks, page_size, 1, 512]``) values into a new
    ``fp8_ds_v4`` cache (:func:`empty_ds_v4_cache`; pad bytes 0)."""
    if x.dim() == 4:
        if x.shape[2] != 1:
            raise ValueError(f"fp8_ds_v4 holds one KV head, got values of shape {list(x.shape)}")
        x = x.squeeze(2)
    if x.dim() != 3:
        raise ValueError(f"pack_ds_v4 takes [num_blocks, page_size, {DS_V4_DIM}] values, got {list(x.shape)}")
    cache = empty_ds_v4_cache(x.shape[0], x.shape[1], device=x.device)
    data, scales = _ds_v4_views(cache)
    data[:], scales[:] = _encode_ds_v4(x)
    return cache


def write_ds_v4(kv_cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Quantise ``x`` ``[n, 512]`` (or ``[n, 1, 512]``) into an ``fp8_ds_v4`` cache at flat slots ``slots``
    (int64 ``[n]``, ``block * page_size + offset``, all in range), in place."""
    if x.dim() == 3:
        x = x.squeeze(1)
    page_size = kv_cache.shape[1]
    data, scales = _ds_v4_views(kv_cache)
    enc_data, enc_scales = _encode_ds_v4(x)
    data[slots // page_size, slots % page_size] = enc_data
    scales[slots // page_size, slots % page_size] = enc_scales


def unpack_ds_v4(kv_cache: torch.Tensor) -> torch.Tensor:
    """Dequantise a whole ``fp8_ds_v4`` cache into fp32 ``[num_blocks, page_size, 1, 512]``."""
    data, scales = _ds_v4_views(kv_cache)
    return _decode_ds_v4(data, scales).unsqueeze(2)
