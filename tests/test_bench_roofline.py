"""Roofline arithmetic (docs/design.md §6) against hand-computed values."""

import pytest
import torch

from mla_dispatch.tools import bench
from mla_dispatch.tools.roofline import Ceilings, Work, decode_work, kv_bytes_per_token, measure_ceilings

DEEPSEEK = dict(num_heads_kv=1, head_dim_qk=576, head_dim_v=512)


def test_bf16_dense_counts():
    # b=128, s_q=1, h_q=128, sum L = 128 * 4096 = 524288
    w = decode_work(batch=128, q_len=1, num_heads_q=128, total_kv_tokens=524288, **DEEPSEEK)
    assert w.flops == 2 * 1 * 128 * (576 + 512) * 524288 == 146_028_888_064
    # 2 * (h_kv*D_qk*sum L + B*s_q*h_q*(D_qk+D_v)) = 2 * (301_989_888 + 17_825_792)
    assert w.bytes == 639_631_360


def test_design_h100_example_is_reproduced():
    """docs/design.md §6: FlashMLA at 292 µs on b=128, L-bar=4K, s_q=1 is ~73% of a 3.00 TB/s / 778 TFLOP/s roofline."""
    h100 = Ceilings("H100", bytes_per_s=3.00e12, flops_per_s=778e12, how="docs/design.md §6")
    w = decode_work(batch=128, q_len=1, num_heads_q=128, total_kv_tokens=128 * 4096, **DEEPSEEK)
    t = w.roofline_seconds(h100)
    assert t == pytest.approx(639_631_360 / 3.00e12)  # memory-bound: 213.2 µs > 187.7 µs of compute
    assert 100 * t / 292e-6 == pytest.approx(73.0, abs=0.1)


def test_s_q_2_heads_and_kv_heads():
    w = decode_work(batch=64, q_len=2, num_heads_q=16, num_heads_kv=2, head_dim_qk=576, head_dim_v=512,
                    total_kv_tokens=64 * 8192)
    assert w.flops == 2 * 2 * 16 * 1088 * 524288 == 36_507_222_016
    assert w.bytes == 2 * (2 * 576 * 524288 + 64 * 2 * 16 * 1088) == 1_212_416_000


def test_fp8_formats_count_stored_bytes():
    qo = 2 * 8 * 1 * 128 * 1088  # q read + out written, bf16
    e4m3 = decode_work(batch=8, q_len=1, num_heads_q=128, total_kv_tokens=10_000, kv_format="fp8_e4m3", **DEEPSEEK)
    ds = decode_work(batch=8, q_len=1, num_heads_q=128, total_kv_tokens=10_000, kv_format="fp8_ds_mla", **DEEPSEEK)
    assert e4m3.bytes == 576 * 10_000 + 4 + qo  # 1 byte per value + the one fp32 scale
    assert ds.bytes == 656 * 10_000 + qo  # 512 fp8 + 4*4 scale bytes + 64*2 rope bytes
    assert e4m3.flops == ds.flops == 2 * 128 * 1088 * 10_000
    assert [kv_bytes_per_token(f, 576) for f in ("bf16", "fp16", "fp8_e4m3", "fp8_ds_mla")] == [1152, 1152, 576, 656]
    with pytest.raises(ValueError, match="kv_format='int4'"):
        kv_bytes_per_token("int4", 576)


def test_sparse_counts_topk_per_query_token():
    w = decode_work(batch=2, q_len=2, num_heads_q=64, total_kv_tokens=999_999, kv_format="fp8_ds_mla", topk=2048,
                    **DEEPSEEK)
    tokens = 2 * 2 * 2048  # every (request, query token) gathers its own 2048
    assert w.flops == 2 * 64 * 1088 * tokens
    assert w.bytes == 656 * tokens + 2 * 2 * 2 * 64 * 1088


def test_roofline_takes_the_slower_ceiling():
    c = Ceilings("x", bytes_per_s=1e9, flops_per_s=1e12, how="")
    assert Work(flops=5e12, bytes=1e9).roofline_seconds(c) == pytest.approx(5.0)  # compute-bound
    assert Work(flops=1e12, bytes=3e9).roofline_seconds(c) == pytest.approx(3.0)  # memory-bound


def test_bench_counts_the_generated_lengths(seed):
    cfg = bench.BenchConfig(3, 2, 16, 100, varlen=True, page_size=16)
    case = bench.make_bench_case(cfg, seed=seed)
    total = int(case.cache_seqlens.sum())
    w = bench.work_of(case, cfg)
    assert w.flops == 2 * 2 * 16 * 1088 * total
    assert w.bytes == 2 * (576 * total + 3 * 2 * 16 * 1088)


def test_cpu_ceilings_are_measured_and_labelled():
    c = measure_ceilings(torch.device("cpu"), copy_bytes=1 << 20, matmul_n=64, rep_ms=5)
    assert c.bytes_per_s > 0 and c.flops_per_s > 0
    assert "1 MiB copy, 64^3 bf16 matmul" in c.how and "CPU" in c.how and "perf_counter" in c.how
