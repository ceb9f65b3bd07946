"""A few small Triton decode runs for `compute-sanitizer --tool memcheck` (dense split, causal page 1, sparse ds_mla;
the 16/32-row three-per-SM configs on the one-page-per-tile, whole-pages (tl.gather) and per-token table paths;
the 64-row config on page 1 with the table prefetched a stage ahead, and with an fp8 cache; bf16 whole tiles by TMA
with 16, 32 and 128 rows; the combine per part boundary where requests outnumber the boundaries). On an H100 / H200 the
bf16 and fp8_e4m3 cases take the Gluon config (decode.GLUON_CONFIG): the seesaw kernel
(kernels/triton/gluon_seesaw.py) on 16-bit pages of whole tiles, the tokens-on-M fp8 kernel (gluon_fp8.py) for
fp8_e4m3 with at most 32 rows, the gluon_sm90 one (every tile gathered by cp.async) on shorter pages and for fp8 with
more rows; five cases force the plain kernel's configs.

    compute-sanitizer --tool memcheck python ci/triton_memcheck.py
    compute-sanitizer --tool racecheck python ci/triton_memcheck.py gluon   # only the cases the Gluon kernel runs
"""
import sys

import torch

from mla_dispatch import plan_decode
from mla_dispatch.numerics.oracle import reference_attention
from mla_dispatch.backends.triton import TritonBackend
from mla_dispatch.kernels.triton.aot_report import parse_spec
from mla_dispatch.numerics.cases import make_case
from mla_dispatch.numerics.tolerance import compare_outputs

g = torch.Generator().manual_seed(7)
cases = [
    (dict(batch=3, q_len=2, num_heads_q=16, seqlen=300, page_size=64, causal=True, zero_len_rows=1), dict(num_parts=20, overhead=1)),
    (dict(batch=2, q_len=1, num_heads_q=128, seqlen=200, page_size=1), {}),
    (dict(batch=2, q_len=2, num_heads_q=16, seqlen=300, page_size=64, topk=64, kv_format="fp8_ds_mla"), {}),
    (dict(batch=3, q_len=1, num_heads_q=16, seqlen=300, page_size=64, zero_len_rows=1), dict(num_parts=20, overhead=1)),
    (dict(batch=3, q_len=1, num_heads_q=16, seqlen=200, page_size=16), {}),
    (dict(batch=2, q_len=1, num_heads_q=16, seqlen=200, page_size=16, kv_format="fp8_e4m3"), {}),
    (dict(batch=2, q_len=1, num_heads_q=32, seqlen=200, page_size=32, kv_format="fp8_ds_mla"), {}),
    (dict(batch=2, q_len=1, num_heads_q=16, seqlen=100, page_size=1, kv_format="fp8_ds_mla"), {}),
    # 64 rows: 64-token tiles, the block table prefetched a stage ahead on small pages
    (dict(batch=3, q_len=1, num_heads_q=64, seqlen=300, page_size=1, zero_len_rows=1), dict(num_parts=20, overhead=1)),
    (dict(batch=2, q_len=1, num_heads_q=64, seqlen=333, page_size=16, kv_format="fp8_e4m3"), {}),
    # bf16 on pages of whole 64-token tiles: whole tiles by TMA (decode.TMA_CONFIGS; the first and fourth cases above
    # take it too), the partial last tile by the gather
    (dict(batch=3, q_len=1, num_heads_q=128, seqlen=300, page_size=64, zero_len_rows=1), dict(num_parts=20, overhead=1)),
    (dict(batch=3, q_len=2, num_heads_q=16, seqlen=500, page_size=128, causal=True), {}),
    (dict(batch=2, q_len=1, num_heads_q=32, seqlen=700, page_size=256), {}),
    # the plain kernel's TMA configs, where the table now picks the Gluon kernel
    (dict(batch=3, q_len=1, num_heads_q=128, seqlen=300, page_size=64, zero_len_rows=1),
     dict(num_parts=20, overhead=1, config=parse_spec("hM64-n64-w8-tma"))),
    (dict(batch=3, q_len=2, num_heads_q=8, seqlen=500, page_size=128, causal=True), dict(config=parse_spec("tM16-n64-s2-tma"))),
    # ... and its small-page configs (decode.SMALL_PAGE_CONFIGS / CONFIGS), where the table now picks the Gluon kernel
    (dict(batch=3, q_len=1, num_heads_q=64, seqlen=300, page_size=1, zero_len_rows=1),
     dict(num_parts=20, overhead=1, config=parse_spec("hM64-n64-w8-s3"))),
    (dict(batch=3, q_len=1, num_heads_q=16, seqlen=200, page_size=16), dict(config=parse_spec("tM16-n32-s2-p3-r168"))),
    # the Gluon kernel on pages that neither hold nor divide a 64-token tile, and on fp8_e4m3 caches (the case with
    # 64 rows and page 16 above takes it too); the plain kernel's fp8 config for 64 rows forced
    (dict(batch=3, q_len=2, num_heads_q=32, seqlen=400, page_size=33, causal=True), dict(num_parts=12, overhead=1)),
    (dict(batch=3, q_len=2, num_heads_q=64, seqlen=300, page_size=64, kv_format="fp8_e4m3", causal=True,
          zero_len_rows=1), dict(num_parts=20, overhead=1)),
    (dict(batch=2, q_len=1, num_heads_q=64, seqlen=333, page_size=16, kv_format="fp8_e4m3"),
     dict(config=parse_spec("hM64-n64-w8"))),
    # the seesaw kernel: fp16, s_q = 3 causal, page 256, items of one to a few tiles
    (dict(batch=3, q_len=3, num_heads_q=128, seqlen=900, page_size=256, causal=True, dtype=torch.float16),
     dict(num_parts=24, overhead=1)),
    # the tokens-on-M fp8 kernel (kernels/triton/gluon_fp8.py; fp8_e4m3 with at most 32 rows, as the 16-head fp8_e4m3
    # case above): 24 rows in a 32-row program, causal, split, zero-length rows, page 33; 32 rows on page 64
    (dict(batch=3, q_len=3, num_heads_q=8, seqlen=500, page_size=33, kv_format="fp8_e4m3", causal=True,
          zero_len_rows=1), dict(num_parts=20, overhead=1)),
    (dict(batch=3, q_len=1, num_heads_q=32, seqlen=700, page_size=64, kv_format="fp8_e4m3"),
     dict(num_parts=24, overhead=1)),
    # more requests than part boundaries: the combine runs one program row per boundary (combine.BY_BOUNDARY)
    (dict(batch=8, q_len=1, num_heads_q=16, seqlen=300, page_size=64, zero_len_rows=1), dict(num_parts=4, overhead=1)),
    (dict(batch=6, q_len=2, num_heads_q=64, seqlen=500, page_size=16, causal=True), dict(num_parts=3, overhead=1)),
]
for kw, ov in cases:
    c = make_case(device="cuda", generator=g, **kw)
    plan = plan_decode(*c.args(), backend="triton", **c.kwargs())
    if ov:
        plan._state = TritonBackend.make_state(plan.problem, plan.platform, plan.cache_seqlens,
                                               block_table=plan.block_table, softmax_scale=plan.softmax_scale, **ov)
    if "gluon" in sys.argv[1:] and not plan.state.cfg.gluon:
        continue
    out, lse = plan.run(c.q, c.kv_cache, kv_scale=c.kv_scale, indices=c.indices)
    ro, rl = reference_attention(*c.args(), **c.kwargs())
    print(kw, compare_outputs(out, lse, ro, rl, TritonBackend.TOLERANCE).message)
