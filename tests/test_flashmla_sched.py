"""FlashMLA's decode schedule computed by us (mla_dispatch/metadata/flashmla_sched.py).

- CPU: the host algorithm on cases worked out by hand from FlashMLA's ``get_mla_metadata_kernel``; the Triton
  kernel equals it bit for bit under the interpreter (a child process, as Triton reads TRITON_INTERPRET at import).
- GPU (``gpu``): both equal the tensors FlashMLA's own first call computes, where FlashMLA is installed.
"""

import json
import random
import sys

import pytest
import torch

from mla_dispatch.metadata.flashmla_sched import flashmla_sched_meta_host, num_sm_parts


def test_hand_worked_schedules():
    # Two requests of 1 block (+5 each = 12 units) on 1 CTA: payload 12 + 5 = 17, both whole.
    assert flashmla_sched_meta_host([10, 64], 1) == ([[0, 1, 0, 1, 0, 0, 0, 0]], [0, 1, 2])
    # One request of 10 blocks (15 units) over 2 CTAs: payload ceil(15/2) + 5 = 13; CTA 0 takes 8 blocks of it,
    # CTA 1 the other 2; the request is split in two.
    assert flashmla_sched_meta_host([640], 2) == ([[0, 0, 0, 8, 0, 1, 1, 0], [0, 0, 8, 10, 1, 1, 1, 0]], [0, 2])
    # A zero-length request still costs one block; its end block is 0 and it is never "split".
    assert flashmla_sched_meta_host([0, 65], 1) == ([[0, 1, 0, 2, 0, 0, 0, 0]], [0, 1, 2])
    assert num_sm_parts(132, 128, 1, 1) == 66 and num_sm_parts(132, 128, 1, 2) == 33 and num_sm_parts(132, 16, 1, 1) == 132


def _cases(seed):
    rng = random.Random(seed)
    for i in range(24):
        b = rng.choice([1, 2, 3, 9, 64, 128])
        parts = rng.choice([1, 3, 33, 66, 132])
        lens = [rng.choice([0, 1, 64, 65, rng.randint(0, 3000), rng.randint(0, 40000)]) for _ in range(b)]
        yield f"case{i}", lens, parts  # ids independent of the seed (the child runs with the session seed)


def _run_cases(seed):
    """Child process (TRITON_INTERPRET=1): the kernel against the host algorithm, one JSON line per case."""
    from mla_dispatch.metadata.flashmla_sched import flashmla_sched_meta_into

    for cid, lens, parts in _cases(seed):
        rows, splits = flashmla_sched_meta_host(lens, parts)
        meta = torch.full((parts, 8), -7, dtype=torch.int32)
        num_splits = torch.full((len(lens) + 1,), -7, dtype=torch.int32)
        flashmla_sched_meta_into(torch.tensor(lens, dtype=torch.int32), meta, num_splits)
        ok = meta.tolist() == rows and num_splits.tolist() == splits
        print(json.dumps({"id": cid, "ok": ok, "message": "" if ok else f"lens={lens} parts={parts}"}), flush=True)


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    from tests.conftest import interpreter_child_results

    return interpreter_child_results(__file__)


@pytest.mark.parametrize("case_id", [c[0] for c in _cases(0)])
def test_kernel_equals_the_host_algorithm_under_the_interpreter(interpreter_results, case_id):
    rec = interpreter_results.get(case_id)
    assert rec is not None, f"case {case_id} did not report (child crashed?)"
    assert rec["ok"], rec["message"]


@pytest.mark.gpu
@pytest.mark.parametrize("b,s_q,h_q", [(1, 1, 128), (7, 2, 128), (128, 1, 128), (64, 1, 16), (33, 4, 64)])
def test_equals_flashmlas_own_schedule(b, s_q, h_q):
    """The tensors FlashMLA's first call computes for itself (its C++ op returns them), bit for bit, but for the
    eighth column of the metadata: DecodingSchedMeta's ``pad``, which FlashMLA never writes (get_decoding_sched_meta.cu
    copies a struct whose pad is uninitialised: it held garbage on the H200, 2026-11-29) and ours writes 0."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    flash_mla = pytest.importorskip("flash_mla")
    if not hasattr(flash_mla, "cuda"):
        pytest.skip("flash_mla has no built extension here")
    from mla_dispatch.metadata.flashmla_sched import flashmla_sched_meta_into

    g = torch.Generator().manual_seed(b * 1000 + h_q)
    lens = torch.randint(0, 5000, (b,), generator=g).to(torch.int32)
    lens[torch.rand(b, generator=g) < 0.2] = 0
    blocks = int((lens.max() + 63) // 64) + 1
    table = torch.randperm(b * blocks, generator=g).view(b, blocks).to(torch.int32).cuda()
    q = (torch.randn(b, s_q, h_q, 576, generator=g) / 10).to(torch.bfloat16).cuda()
    kv = (torch.randn(b * blocks, 64, 1, 576, generator=g) / 10).to(torch.bfloat16).cuda()
    seqlens = lens.cuda()
    _, _, want_meta, want_splits = flash_mla.cuda.dense_decode_fwd(q, kv, 512, seqlens, table, 576**-0.5, s_q > 1,
                                                                   None, None)
    parts = num_sm_parts(torch.cuda.get_device_properties(0).multi_processor_count, h_q, 1, s_q)
    assert want_meta.shape == (parts, 8)
    meta = torch.full_like(want_meta, -7)
    splits = torch.full_like(want_splits, -7)
    flashmla_sched_meta_into(seqlens, meta, splits)
    assert torch.equal(meta[:, :7], want_meta[:, :7]) and torch.equal(splits, want_splits)
    assert not meta[:, 7].any()
    rows, host_splits = flashmla_sched_meta_host(lens.tolist(), parts)
    assert [r[:7] for r in want_meta.tolist()] == [r[:7] for r in rows] and want_splits.tolist() == host_splits
    assert all(r[7] == 0 for r in rows)


if __name__ == "__main__":
    _run_cases(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
