"""The split-KV schedule, the combine, and the vendor-metadata conversions."""

import pytest
import torch

from mla_dispatch.numerics.oracle import reference_attention
from mla_dispatch.metadata.combine import combine_splits, first_slots
from mla_dispatch.metadata.conversions import kv_indptr, kv_last_page_lens, repage_block_table, token_indices
from mla_dispatch.metadata.schedule import ITEM_BEGIN, ITEM_END, ITEM_REQ, ITEM_SLOT, split_kv_schedule
from mla_dispatch.numerics.cases import make_case
from mla_dispatch.numerics.tolerance import check_close


def _random_lengths(gen, batch):
    lens = torch.randint(0, 3000, (batch,), generator=gen)
    lens[torch.rand(batch, generator=gen) < 0.2] = 0
    return lens.to(torch.int32)


@pytest.mark.parametrize("batch,num_parts,chunk,overhead", [(1, 1, 64, 1), (1, 132, 64, 5), (7, 3, 16, 2),
                                                            (64, 132, 64, 5), (300, 17, 128, 4)])
def test_every_token_covered_exactly_once(batch, num_parts, chunk, overhead, gen):
    lens = _random_lengths(gen, batch)
    sched = split_kv_schedule(lens, num_parts=num_parts, chunk_size=chunk, overhead=overhead)
    assert sched.items.shape == (batch + num_parts, 4) and sched.part_offsets.shape == (num_parts + 1,)
    covered = [torch.zeros(int(n), dtype=torch.int32) for n in lens]
    owners = torch.zeros(batch, dtype=torch.int32)
    slots_seen = set()
    for part in sched.to_list():
        reqs = [it[0] for it in part]
        assert reqs == sorted(reqs), "a part's items are in request order"
        for req, begin, end, slot in part:
            assert 0 <= req < batch and 0 <= begin <= end <= int(lens[req])
            covered[req][begin:end] += 1
            owners[req] += 1
            if begin < end and end < int(lens[req]):
                assert (end - begin) % chunk == 0 or begin % chunk == 0, "splits fall on chunk boundaries"
            if slot >= 0:
                assert slot not in slots_seen
                slots_seen.add(slot)
                assert int(sched.slot_req[slot]) == req
    for req in range(batch):
        assert torch.all(covered[req] == 1), f"request {req}: every token exactly once"
        assert int(owners[req]) == int(sched.num_splits[req]) >= 1
    # Slots exist exactly for split requests; unused item rows are padding.
    n_items = int(sched.part_offsets[-1])
    assert torch.all(sched.items[n_items:, 0] == -1)
    split_slots = int(sched.num_splits[sched.num_splits > 1].sum())
    assert len(slots_seen) == split_slots == int((sched.slot_req >= 0).sum())
    assert sched.max_slots >= split_slots


def test_balance_is_within_one_chunk_plus_overhead(gen):
    lens = _random_lengths(gen, 40)
    chunk, overhead, parts = 64, 5, 16
    sched = split_kv_schedule(lens, num_parts=parts, chunk_size=chunk, overhead=overhead)
    costs = []
    for part in sched.to_list():
        c = 0
        for req, b, e, _ in part:
            c += (e - b + chunk - 1) // chunk + overhead
        costs.append(c)
    total = int(((lens.long() + chunk - 1) // chunk + overhead).sum())
    assert max(costs) <= -(-total // parts) + 2 * overhead + 1


def test_zero_length_and_empty_batch_members_get_one_item():
    sched = split_kv_schedule(torch.tensor([0, 0, 5], dtype=torch.int32), num_parts=8, chunk_size=4, overhead=1)
    items = [it for part in sched.to_list() for it in part]
    assert items == [(0, 0, 0, -1), (1, 0, 0, -1), (2, 0, 4, 0), (2, 4, 5, 1)]


def test_update_in_place_keeps_buffers(gen):
    sched = split_kv_schedule(_random_lengths(gen, 9), num_parts=5)
    ptrs = [t.data_ptr() for t in (sched.items, sched.part_offsets, sched.num_splits, sched.slot_req)]
    new = _random_lengths(gen, 9)
    sched.update_(new)
    assert ptrs == [t.data_ptr() for t in (sched.items, sched.part_offsets, sched.num_splits, sched.slot_req)]
    fresh = split_kv_schedule(new, num_parts=5)
    assert torch.equal(sched.items, fresh.items) and torch.equal(sched.part_offsets, fresh.part_offsets)


@pytest.mark.parametrize("causal", [False, True])
def test_combine_of_partials_equals_unsplit_result(causal, gen):
    case = make_case(5, 2, 8, 200, page_size=16, causal=causal, zero_len_rows=1, generator=gen,
                     head_dim_qk=64, head_dim_v=48)
    lens = case.cache_seqlens
    sched = split_kv_schedule(lens, num_parts=7, chunk_size=16, overhead=1)
    batch, q_len, h_q = 5, 2, 8
    out = torch.full((batch, q_len, h_q, 48), float("nan"))
    lse = torch.full((batch, h_q, q_len), float("nan"))
    p_out = torch.full((sched.max_slots, q_len, h_q, 48), float("nan"))
    p_lse = torch.full((sched.max_slots, q_len, h_q), float("nan"))
    pos_all = torch.arange(case.block_table.shape[1] * 16)
    for part in sched.to_list():
        for req, begin, end, slot in part:
            # Attend to tokens [begin, end) only: an index list per query token, with the causal cut applied.
            L = int(lens[req])
            idx = torch.full((1, q_len, max(end - begin, 1)), -1, dtype=torch.int32)
            for i in range(q_len):
                limit = L - q_len + i + 1 if causal else L
                toks = pos_all[begin:min(end, max(limit, 0))]
                slots = case.block_table[req, toks // 16].long() * 16 + toks % 16
                idx[0, i, : len(slots)] = slots.to(torch.int32)
            o, l = reference_attention(case.q[req:req + 1], case.kv_cache, None, None, head_dim_v=48,
                                       softmax_scale=case.softmax_scale, indices=idx)
            if slot < 0:
                out[req], lse[req] = o[0].to(out.dtype), l[0]
            else:
                p_out[slot] = o[0]
                p_lse[slot] = torch.where(torch.isposinf(l[0]), float("-inf"), l[0]).transpose(0, 1)
    combine_splits(p_out, p_lse, sched, out, lse)
    want_out, want_lse = reference_attention(*case.args(), **case.kwargs())
    assert int((sched.num_splits > 1).sum()) >= 1, "the case must exercise splitting"
    assert check_close("out", out, want_out, 1e-6, 1e-5)
    assert check_close("lse", lse, want_lse, 1e-6, 1e-6)


def test_indptr_last_page_and_token_indices():
    table = torch.tensor([[3, 1, 9], [2, 7, 7], [5, 5, 5]], dtype=torch.int32)
    lens = torch.tensor([5, 2, 0], dtype=torch.int32)
    assert kv_indptr(lens, 2).tolist() == [0, 3, 4, 4]
    assert kv_last_page_lens(lens, 2).tolist() == [1, 2, 0]
    indptr, idx = token_indices(table, lens, 2)
    assert indptr.tolist() == [0, 5, 7, 7]
    assert idx[:7].tolist() == [6, 7, 2, 3, 18, 4, 5]


def test_repage_block_table_views_the_same_tokens(gen):
    kv = torch.randn(6, 8, 1, 4, generator=gen)
    table = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)
    small = repage_block_table(table, 8, 2)
    kv_small = kv.view(24, 2, 1, 4)
    for b in range(2):
        for j in range(16):
            assert torch.equal(kv[table[b, j // 8], j % 8], kv_small[small[b, j // 2], j % 2])
    with pytest.raises(ValueError, match="must divide"):
        repage_block_table(table, 8, 3)


def test_schedule_argument_errors():
    with pytest.raises(ValueError, match="num_parts must be >= 1"):
        split_kv_schedule(torch.zeros(2, dtype=torch.int32), num_parts=0)
    with pytest.raises(ValueError, match="1-D int32"):
        split_kv_schedule(torch.zeros(2, dtype=torch.int64), num_parts=2)


def test_first_slots_match_the_schedule(gen):
    # The combine finds a split request's partials at first_slot[b] .. first_slot[b] + num_splits[b] - 1.
    # The item columns are read through their names (ITEM_*) and positionally (the kernels read [req, begin, end,
    # slot] by offset), so a name that points at the wrong column fails here.
    lens = torch.randint(0, 3000, (37,), generator=gen, dtype=torch.int32)
    lens[::5] = 0
    sched = split_kv_schedule(lens, num_parts=11, chunk_size=64, overhead=5)
    first = first_slots(sched.num_splits)
    named = sched.items[:, [ITEM_REQ, ITEM_BEGIN, ITEM_END, ITEM_SLOT]]
    assert torch.equal(named, sched.items), "ITEM_* do not name the columns the kernels read"
    seen = {}
    for req, begin, end, slot in named.tolist():
        if req < 0:
            continue
        assert 0 <= begin <= end <= int(lens[req]), (req, begin, end)
        if sched.num_splits[req] > 1:
            seen.setdefault(req, []).append(slot)
        else:
            assert slot == -1
    assert seen, "the draw produced no split request"
    for req, slots in seen.items():
        n = int(sched.num_splits[req])
        assert sorted(slots) == list(range(int(first[req]), int(first[req]) + n))


@pytest.mark.parametrize("batch,num_parts,chunk,overhead", [(37, 11, 64, 5), (300, 17, 128, 4), (64, 132, 64, 5),
                                                            (5, 40, 16, 1), (200, 66, 64, 5)])
def test_each_split_request_has_one_boundary_owner(batch, num_parts, chunk, overhead, gen):
    """The combine kernels' per-boundary grid (cuda_sm90 combine.cuh, triton combine.py) relies on this: a split
    request's second slot is the first item of the part after one of its boundaries, so the boundary whose next
    part starts with (request r, slot first_slot[r] + 1) merges r, and no other boundary claims r."""
    lens = _random_lengths(gen, batch)
    sched = split_kv_schedule(lens, num_parts=num_parts, chunk_size=chunk, overhead=overhead)
    first = first_slots(sched.num_splits)
    offsets, items = sched.part_offsets.tolist(), sched.items.tolist()
    owners = {}
    for k in range(num_parts - 1):  # boundary between parts k and k + 1
        it = offsets[k + 1]
        if it >= offsets[k + 2]:
            continue
        req, _, _, slot = items[it]
        if req >= 0 and slot >= 0 and slot == int(first[req]) + 1:
            assert req not in owners, f"request {req} claimed by boundaries {owners[req]} and {k}"
            owners[req] = k
    split = {int(r) for r in torch.nonzero(sched.num_splits > 1).flatten()}
    assert split, "the draw produced no split request"
    assert set(owners) == split
    assert len(split) <= num_parts - 1


def test_combine_does_not_hide_a_nan_piece(gen):
    """A piece that saw keys but holds a NaN makes its row NaN (the torch combine used to zero it); a piece that saw
    none (lse -inf) is not read, whatever it holds."""
    lens = torch.tensor([300, 40, 500], dtype=torch.int32)
    sched = split_kv_schedule(lens, num_parts=6, chunk_size=16, overhead=1)
    slot_req = sched.slot_req.tolist()
    split = [b for b in range(3) if int(sched.num_splits[b]) > 1]
    assert len(split) >= 1, "the case must exercise splitting"
    r = split[0]
    first, second = [s for s, q in enumerate(slot_req) if q == r][:2]
    p_out = torch.randn(sched.max_slots, 1, 2, 8, generator=gen)
    p_lse = torch.randn(sched.max_slots, 1, 2, generator=gen)
    p_out[first, 0, 0, 3] = float("nan")
    p_lse[second, 0, 1], p_out[second, 0, 1] = float("-inf"), float("nan")
    out = torch.zeros(3, 1, 2, 8)
    lse = torch.zeros(3, 2, 1)
    combine_splits(p_out, p_lse, sched, out, lse)
    assert torch.isnan(out[r, 0, 0, 3]) and int(torch.isnan(out).sum()) == 1
    assert not torch.isnan(lse).any()
