"""PagedMLACache: round trips, all-or-nothing appends, quantisation error bounds."""

import pytest
import torch

import mla_dispatch
from mla_dispatch.kvcache.cache import CacheFullError, PagedMLACache
from mla_dispatch.kvcache.formats import pack_ds_mla, unpack_ds_mla


def _values(gen, n, d=576, h=1):
    return (torch.randn(n, h, d, generator=gen) / 10).clamp(-1, 1)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_append_round_trip_bf16(page_size, gen):
    cache = PagedMLACache(100, page_size, head_dim=96, num_heads_kv=2)
    a, b = _values(gen, 70, 96, 2), _values(gen, 5, 96, 2)
    for name in "ab":
        cache.add_sequence(name)
    cache.append("a", a[:30])
    cache.append(["a", "b"], [a[30:], b])
    assert cache.seq_len("a") == 70 and cache.seq_len("b") == 5
    assert torch.equal(cache.gather("a"), a.to(torch.bfloat16).float())
    assert torch.equal(cache.gather("b"), b.to(torch.bfloat16).float())
    table, lens = cache.decode_inputs(["b", "a"])
    assert lens.tolist() == [5, 70] and table.dtype == torch.int32
    # Tokens land where block_table says they are.
    ps = page_size
    for j in (0, 29, 69):
        blk = int(table[1, j // ps])
        assert torch.equal(cache.kv[blk, j % ps].float(), a[j].to(torch.bfloat16).float())


def test_capacity_error_leaves_cache_unchanged(gen):
    cache = PagedMLACache(4, 8, head_dim=32)
    cache.add_sequence(1)
    cache.add_sequence(2)
    cache.append(1, _values(gen, 20, 32))  # 3 blocks
    before = cache.kv.clone()
    free_before = cache.num_free_blocks
    with pytest.raises(CacheFullError, match="needs 2 free blocks of 8 tokens, 1 are free"):
        cache.append([1, 2], [_values(gen, 4, 32), _values(gen, 9, 32)])
    assert torch.equal(cache.kv, before)
    assert cache.num_free_blocks == free_before and cache.seq_len(1) == 20 and cache.seq_len(2) == 0
    with pytest.raises(KeyError, match="unknown sequence 3"):
        cache.append([1, 3], [_values(gen, 1, 32), _values(gen, 1, 32)])
    assert torch.equal(cache.kv, before) and cache.seq_len(1) == 20
    with pytest.raises(ValueError, match=r"values must be \[n, 1, 32\]"):
        cache.append(1, torch.zeros(3, 33))


def test_free_returns_blocks_and_reuses_them(gen):
    cache = PagedMLACache(3, 4, head_dim=16)
    cache.add_sequence("x")
    cache.append("x", _values(gen, 12, 16))
    assert cache.num_free_blocks == 0
    cache.free("x")
    assert cache.num_free_blocks == 3 and "x" not in cache
    cache.add_sequence("y")
    cache.append("y", _values(gen, 12, 16))
    with pytest.raises(ValueError, match="already exists"):
        cache.add_sequence("y")


def test_write_slots_skips_minus_one_and_checks_range(gen):
    cache = PagedMLACache(2, 4, head_dim=16)
    v = _values(gen, 3, 16)
    cache.write_slots(torch.tensor([5, -1, 0]), v)
    flat = cache.kv.view(8, 1, 16).float()
    assert torch.equal(flat[5], v[0].to(torch.bfloat16).float())
    assert torch.equal(flat[0], v[2].to(torch.bfloat16).float())
    assert torch.all(flat[[1, 2, 3, 4, 6, 7]] == 0)
    with pytest.raises(ValueError, match=r"slot_mapping entries must be in \[-1, 8\)"):
        cache.write_slots(torch.tensor([8]), v[:1])


def test_fp8_e4m3_round_trip_error_bound(gen):
    scale = 1.0 / 448 * 1.1
    cache = PagedMLACache(4, 16, kv_format="fp8_e4m3", kv_scale=scale)
    cache.add_sequence(0)
    x = _values(gen, 50)
    cache.append(0, x)
    back = cache.gather(0)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals; subnormals are
    # spaced 2^-9 * scale apart, so the absolute error there is at most half that.
    err = (back - x).abs()
    assert torch.all(err <= torch.maximum(x.abs() * 2**-4, torch.full_like(x, 2**-10 * scale)))


def test_fp8_ds_mla_format_and_error_bound(gen):
    x = _values(gen, 64) * 3
    packed = pack_ds_mla(x)
    assert packed.shape == (64, 1, 656) and packed.dtype == torch.uint8
    scales = packed[..., 512:528].contiguous().view(torch.float32)
    assert torch.all(torch.log2(scales) == torch.round(torch.log2(scales))), "scales are powers of two"
    rope = packed[..., 528:].contiguous().view(torch.bfloat16)
    assert torch.equal(rope, x[..., 512:].to(torch.bfloat16)), "RoPE part is stored unquantised in bf16"
    back = unpack_ds_mla(packed)
    # Same e4m3 bound as above, with each 128-value tile's own scale.
    tile_scale = scales.repeat_interleave(128, -1)
    nope = x[..., :512]
    assert torch.all((back[..., :512] - nope).abs() <= torch.maximum(nope.abs() * 2**-4, 2**-10 * tile_scale))
    cache = PagedMLACache(2, 64, kv_format="fp8_ds_mla")
    cache.add_sequence(0)
    cache.append(0, x)
    assert torch.equal(cache.gather(0), back)


def test_cache_object_feeds_mla_decode(gen):
    cache = PagedMLACache(8, 16, kv_format="fp8_e4m3", kv_scale=0.01)
    for s, n in ((0, 33), (1, 0), (2, 16)):
        cache.add_sequence(s)
        if n:
            cache.append(s, _values(gen, n))
    table, lens = cache.decode_inputs([0, 1, 2])
    q = torch.randn(3, 1, 4, 576, generator=gen).to(torch.bfloat16)
    out, lse = mla_dispatch.mla_decode(q, cache, table, lens)
    assert torch.isposinf(lse[1]).all() and (out[1] == 0).all() and torch.isfinite(lse[[0, 2]]).all()


def test_constructor_errors():
    with pytest.raises(ValueError, match="kv_format='fp8_e4m3' needs a positive kv_scale"):
        PagedMLACache(2, 4, kv_format="fp8_e4m3")
    with pytest.raises(ValueError, match="kv_format must be one of"):
        PagedMLACache(2, 4, kv_format="int4")
    with pytest.raises(ValueError, match="fp8_ds_mla.*head_dim=512"):
        PagedMLACache(2, 4, kv_format="fp8_ds_mla", head_dim=512)
