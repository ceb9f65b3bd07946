"""dev/flashmla_test.py's ``--reuse-meta`` wrapper on the CPU (reference backend): the meta is filled by a call on
a permuted table and cache, and the caller's own call, reusing it, still reads its own table."""

import importlib.util
import pathlib
import types

import torch

from mla_dispatch import get_backend
from mla_dispatch.compat import flash_mla as fm
from mla_dispatch.numerics.cases import make_case
from mla_dispatch.numerics.oracle import reference_attention
from mla_dispatch.numerics.tolerance import compare_outputs

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("flashmla_test", _ROOT / "flashmla_test.py")
flashmla_test = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(flashmla_test)


def test_reuse_meta_fills_the_meta_with_another_table_first(seed):
    gen = torch.Generator().manual_seed(seed)
    c = make_case(4, 2, 8, 300, causal=True, generator=gen)  # FlashMLA's data: permuted table, NaN in unused slots
    module = types.SimpleNamespace(FlashMLASchedMeta=fm.FlashMLASchedMeta)
    seen = []

    def spy(q, k_cache, block_table, *args, **kwargs):
        seen.append((k_cache, block_table))
        return fm.flash_mla_with_kvcache(q, k_cache, block_table, *args, **kwargs)

    module.flash_mla_with_kvcache = spy
    flashmla_test._fill_meta_with_another_table(module, torch)
    meta, _ = fm.get_mla_metadata()
    out, lse = module.flash_mla_with_kvcache(c.q, c.kv_cache, c.block_table, c.cache_seqlens, 512, meta, None,
                                             causal=True)
    (kv1, table1), (kv2, table2) = seen
    assert kv2 is c.kv_cache and table2 is c.block_table and kv1 is not c.kv_cache
    assert not torch.equal(table1, c.block_table)  # the meta was filled with another table
    want_out, want_lse = reference_attention(c.q, c.kv_cache, c.block_table, c.cache_seqlens, causal=True)
    report = compare_outputs(out, lse, want_out, want_lse, get_backend("reference").TOLERANCE)
    assert report, report.message
    assert meta.plan.block_table is c.block_table
