"""How fast can the H200 read a sparse decode's rows at all? (issue 57: the memory roofline of the dsv32 grid counts
the bytes of the selected tokens as if they streamed; they are gathered, one 656-byte row per top-k id.)

    python dev/gather_ceiling.py [--grid dsv32] [--heads 16]

For the bench grid's configs with ``--heads`` heads (the inputs ``bench`` times, same seed: tools/bench.py,
make_bench_case), a read-only Triton kernel loads every row the top-k ids select (64 rows per program, the row's
bytes as int32 words, summed to one word per program so that nothing but the gather moves), and again the same number
of rows in cache order (ids sorted within the whole list: the rows of a block one after another). CUDA-graph-free
do_bench (L2 flushed before each run, median). Prints the gather's time, its bandwidth, and the same for the sorted
read. Not part of the product; needs a GPU and Triton.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from mla_dispatch.tools.bench import GRIDS, make_bench_case


@triton.jit
def _gather_rows(words, ids, out, n_ids, ROW_WORDS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * ROWS + tl.arange(0, ROWS)
    live = r < n_ids
    row = tl.load(ids + r, mask=live, other=0).to(tl.int64)
    c = tl.arange(0, COLS)
    x = tl.load(words + row[:, None] * ROW_WORDS + c[None, :], mask=live[:, None] & (c[None, :] < ROW_WORDS), other=0)
    tl.store(out + pid, tl.sum(tl.sum(x, axis=1), axis=0))


def measure(case, row_bytes: int) -> tuple[float, float, int]:
    """(gather us, sorted us, rows) of the case's valid top-k ids over its cache, whose rows are ``row_bytes`` apart
    (one KV head: token id = row)."""
    kv = case.kv_cache
    words = kv.view(torch.uint8).reshape(-1).view(torch.int32)
    ids = case.indices.reshape(-1)
    ids = ids[ids >= 0].to(torch.int32).contiguous()
    row_words = row_bytes // 4
    cols = triton.next_power_of_2(row_words)
    out = torch.empty(triton.cdiv(ids.numel(), 64), dtype=torch.int32, device=ids.device)

    def run(id_list):
        return lambda: _gather_rows[(out.numel(),)](words, id_list, out, id_list.numel(), ROW_WORDS=row_words,
                                                    ROWS=64, COLS=cols, num_warps=8)

    gather = triton.testing.do_bench(run(ids), warmup=25, rep=200)
    ordered = triton.testing.do_bench(run(torch.sort(ids).values.contiguous()), warmup=25, rep=200)
    return gather * 1e3, ordered * 1e3, ids.numel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--grid", default="dsv32")
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args()
    for cfg in GRIDS[args.grid][1]():
        if cfg.num_heads_q != args.heads:
            continue
        case = make_bench_case(cfg, device="cuda")
        if cfg.kv_format == "fp8_ds_mla":
            row_bytes = 656
        else:
            raise SystemExit(f"{cfg.kv_format}: rows of one stride only (fp8_ds_mla)")
        us, us_sorted, rows = measure(case, row_bytes)
        gbytes = rows * row_bytes / 1e9
        print(f"{cfg.label}: {rows} rows of {row_bytes} B ({gbytes * 1e3:.0f} MB): gather {us:.1f} us "
              f"({gbytes / us * 1e3:.2f} TB/s), same rows sorted {us_sorted:.1f} us ({gbytes / us_sorted * 1e3:.2f} TB/s)")


if __name__ == "__main__":
    main()
