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


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_format="fp8_e4m3", kv_scale=float("inf")), "kv_format='fp8_e4m3' needs a positive kv_scale, a finite"),
    (dict(kv_format="fp8_e4m3", kv_scale=float("nan")), "kv_format='fp8_e4m3' needs a positive kv_scale, a finite"),
    (dict(kv_format="fp8_e4m3", kv_scale=-1.0), "kv_format='fp8_e4m3' needs a positive kv_scale"),
    (dict(kv_format="bf16", kv_scale=0.5), "kv_scale is only used with kv_format='fp8_e4m3'"),
    (dict(head_dim=0), "head_dim must be an int >= 1, got 0"),
    (dict(num_heads_kv=0), "num_heads_kv must be an int >= 1, got 0"),
    (dict(head_dim=8.0), "head_dim must be an int >= 1, got 8.0"),
], ids=["scale-inf", "scale-nan", "scale-negative", "scale-for-bf16", "head_dim-0", "heads-0", "head_dim-float"])
def test_constructor_refuses_values_that_make_a_broken_cache(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PagedMLACache(2, 4, **kwargs)


def test_list_of_values_needs_a_list_of_ids(gen):
    """append("ab", [t1, t2]) once appended to sequences "a" and "b"."""
    cache = PagedMLACache(4, 4, head_dim=8)
    for sid in ("a", "b", "ab"):
        cache.add_sequence(sid)
    t1, t2 = torch.randn(2, 8, generator=gen), torch.randn(3, 8, generator=gen)
    with pytest.raises(ValueError, match="seq_id must be a list of sequence ids when values is a list"):
        cache.append("ab", [t1, t2])
    assert [cache.seq_len(s) for s in ("a", "b", "ab")] == [0, 0, 0] and cache.num_free_blocks == 4
    cache.append(("a", "b"), [t1, t2])  # a tuple of ids is a list of ids
    cache.append("ab", t1)  # one id, one tensor
    assert [cache.seq_len(s) for s in ("a", "b", "ab")] == [2, 3, 2]


def test_values_that_require_grad_are_stored_as_values(gen):
    cache = PagedMLACache(4, 4, head_dim=8)
    cache.add_sequence("a")
    values = torch.randn(5, 8, generator=gen, requires_grad=True)
    slots = cache.append("a", values * 2)
    cache.write_slots(slots[:2], values[:2])
    assert not cache.kv.requires_grad and cache.kv.grad_fn is None
    want = torch.cat([values[:2], values[2:] * 2]).detach().bfloat16().float()
    assert torch.equal(cache.gather("a")[:, 0], want)


# -- concurrent calls ---------------------------------------------------------------------------


def _hammer(cache, workers, rounds, seed, free_some):
    """``workers`` threads, each appending ``rounds`` chunks of random sizes to its own sequences (and, with
    ``free_some``, freeing and re-adding one of them now and then) while the others do the same; returns each
    live sequence's expected fp32 tokens. Threads start together (a barrier) and the interpreter switches threads
    every microsecond, so the calls interleave inside each other."""
    import sys
    import threading

    expected, errors = {}, []
    barrier = threading.Barrier(workers)

    def work(w):
        g = torch.Generator().manual_seed(seed + w)
        ids = [(w, 0), (w, 1)]
        try:
            for sid in ids:
                cache.add_sequence(sid)
                expected[sid] = []
            barrier.wait()
            for r in range(rounds):
                sid = ids[r % 2]
                n = int(torch.randint(1, 6, (1,), generator=g))
                values = torch.randn(n, 1, cache.head_dim, generator=g).bfloat16()
                if r % 7 == 3:  # two sequences in one call (all or nothing)
                    other = ids[1 - r % 2]
                    more = torch.randn(2, 1, cache.head_dim, generator=g).bfloat16()
                    cache.append([sid, other], [values, more])
                    expected[other].append(more.float())
                else:
                    cache.append(sid, values)
                expected[sid].append(values.float())
                table, lens = cache.decode_inputs(ids)  # reads the bookkeeping while others change it
                assert int(lens[r % 2]) == sum(v.shape[0] for v in expected[sid])
                if free_some and r % 11 == 10:
                    cache.free(sid)
                    cache.add_sequence(sid)
                    expected[sid] = []
        except Exception as exc:  # reported by the main thread
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[0]
    return {sid: torch.cat(chunks) if chunks else torch.empty(0, 1, cache.head_dim) for sid, chunks in expected.items()}


@pytest.mark.parametrize("free_some", [False, True], ids=["append", "append-free"])
def test_concurrent_appends_keep_the_bookkeeping_and_the_tokens(seed, free_some):
    """Engines call from worker threads: 8 threads x 60 appends each, 4 trials. Every block is owned by at most one
    sequence or free (none lost, none twice), and every sequence reads back exactly what its thread appended."""
    for trial in range(4):
        cache = PagedMLACache(num_blocks=700, page_size=4, head_dim=8, kv_format="bf16")  # room for all of it
        expected = _hammer(cache, workers=8, rounds=60, seed=seed + 1000 * trial, free_some=free_some)
        owned = [b for sid in expected for b in cache._seqs[sid].blocks]
        assert len(owned) == len(set(owned)), f"trial {trial}: a block is owned twice"
        assert sorted(owned + cache._free) == list(range(cache.num_blocks)), f"trial {trial}: blocks leaked"
        for sid, want in expected.items():
            assert cache.seq_len(sid) == want.shape[0]
            assert torch.equal(cache.gather(sid), want), f"trial {trial}: sequence {sid} reads other tokens"


def test_a_copied_cache_has_its_own_bookkeeping_and_lock(gen):
    import copy

    cache = PagedMLACache(num_blocks=6, page_size=4, head_dim=8)
    cache.add_sequence("a")
    cache.append("a", torch.randn(5, 8, generator=gen))
    twin = copy.deepcopy(cache)
    twin.append("a", torch.randn(4, 8, generator=gen))
    assert cache.seq_len("a") == 5 and twin.seq_len("a") == 9
    assert cache.num_free_blocks == 4 and twin.num_free_blocks == 3
    assert twin._lock is not cache._lock
