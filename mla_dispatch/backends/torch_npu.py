"""Huawei's own MLA decode kernels through torch_npu (the vendor fallback on Ascend).

Which op, in order of preference (what vllm-ascend and SGLang call, see
``shared/reference/peer_apis.md`` §4 and ``ascend.md`` §5):

1. ``torch_npu.npu_fused_infer_attention_score_v2`` (FIA v2; with ``query_rope``
   / ``key_rope`` it routes to the AMLA "NonQuantMla" template),
2. ``torch_npu.npu_fused_infer_attention_score`` (FIA v1, same kernel),
3. ``torch_npu._npu_paged_attention_mla`` (legacy ATB paged attention).

Argument conventions, from the op-plugin doc
``docs/context/torch_npu-npu_fused_infer_attention_score_v2.md`` (MLA mode):
``query`` is the 512 NoPE channels and ``query_rope`` the 64 RoPE channels;
``key = value`` is the NoPE cache and ``key_rope`` the RoPE cache (split
tensors); PageAttention is mandatory with ``block_size`` 16 or 128; query heads
N must be 32, 64 or 128 and KV heads 1; Q_S = 1 only with ``sparse_mode=0`` and
no mask; ``actual_seq_kvlen`` is a host list. **FIA's MLA mode cannot return the
softmax LSE** (same doc: "不支持开启SoftMaxLse"), nor can the legacy op, so this
backend runs only problems with ``return_lse=False``.

How the canonical layout is adapted:

* the interleaved ``[nb, ps, 1, 576]`` cache is split into contiguous NoPE/RoPE
  tensors (the doc rejects non-contiguous key/value): a copy of the cache per
  call, which makes this a correct but slow fallback; the legacy op and our own
  kernel read the interleaved cache directly,
* pages of any multiple of 16 are re-viewed as pages of 128 (when 128 divides
  the page size) or 16 (``metadata.repage_block_table``, a pure view),
* heads are zero-padded to a power of two >= 32 (as vllm-ascend does) and the
  padding sliced off,
* ``s_q > 1`` is folded into the batch: query token ``i`` of request ``b``
  becomes its own request with length ``L_b - s_q + 1 + i`` (causal) or ``L_b``,
  so only the documented Q_S = 1, ``sparse_mode=0`` path is used,
* rows with no visible key are written as 0 here (the vendor's behaviour for
  empty rows is not relied on).

Detection never breaks ``import torch``: torch_npu is imported only if it is
installed, inside ``try`` (without CANN it raises ImportError: libhccl.so), and
never at module import. Do not install torch-npu into CPU/GPU environments:
its ``torch.backends`` entry point makes ``import torch`` itself fail there
unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``.
"""

from __future__ import annotations

import importlib.util
import sys

import torch

from mla_dispatch.dispatch.backend import ArchSupport, BackendState, CGSupport, MLABackend, Reason, ReasonCode
from mla_dispatch.numerics.tolerance import Tolerance
from mla_dispatch.metadata.conversions import repage_block_table
from mla_dispatch.dispatch.problem import DecodeProblem

__all__ = ["TorchNpuBackend", "load_torch_npu", "vendor_op"]

NOPE_DIM = 512
ROPE_DIM = 64
FIA_HEADS = (32, 64, 128)
VENDOR_OPS = ("npu_fused_infer_attention_score_v2", "npu_fused_infer_attention_score", "_npu_paged_attention_mla")


def load_torch_npu():
    """``(module, None)`` or ``(None, why)``; never raises, never imports torch_npu if absent."""
    if "torch_npu" in sys.modules:
        return sys.modules["torch_npu"], None
    if importlib.util.find_spec("torch_npu") is None:
        return None, "torch_npu is not installed (it needs the CANN toolkit and an Ascend NPU)"
    try:
        import torch_npu
    except Exception as exc:  # ImportError: libhccl.so without CANN, RuntimeError from autoload, ...
        return None, f"import torch_npu failed: {type(exc).__name__}: {exc}"
    return torch_npu, None


def vendor_op(torch_npu) -> tuple[str, object] | tuple[None, None]:
    """The first of :data:`VENDOR_OPS` this torch_npu has."""
    for name in VENDOR_OPS:
        fn = getattr(torch_npu, name, None)
        if fn is not None:
            return name, fn
    return None, None


def padded_heads(num_heads: int) -> int:
    """Heads after padding: the next power of two, at least 32 (FIA MLA supports N in {32, 64, 128})."""
    return max(FIA_HEADS[0], 1 << (num_heads - 1).bit_length())


class TorchNpuBackend(MLABackend):
    """Huawei's FIA (AMLA template) or legacy ATB MLA kernel via torch_npu."""

    NAME = "torch_npu"
    VENDOR = "Huawei CANN"
    DESCRIPTION = "torch_npu npu_fused_infer_attention_score[_v2] / _npu_paged_attention_mla"
    PLATFORMS = frozenset({"npu"})
    ARCHS = frozenset({"Ascend910B", "Ascend910C"})
    KV_FORMATS = frozenset({"bf16", "fp16"})
    HEAD_DIMS = frozenset({(NOPE_DIM + ROPE_DIM, NOPE_DIM)})
    MAX_HEADS_Q = 128
    MAX_HEADS_KV = 1
    PAGE_SIZE_MULTIPLE = 16  # re-viewed as FIA block_size 128 or 16
    SUPPORTS_LSE = False  # FIA MLA mode and the legacy op return no LSE
    CUDA_GRAPH = CGSupport.NEVER
    ANY_OUT_STRIDES = True  # out.copy_(...)
    TOLERANCE = Tolerance()
    ARCH_SUPPORT = (ArchSupport("910B/910C", "Ascend 910B/910C",
                                notes="npu_fused_infer_attention_score[_v2] (FIA in MLA mode) or the ATB MLA op: pages "
                                      "of 16 or 128, heads zero-padded to 32/64/128, s_q > 1 folded into the batch",
                                run_here="no: contract-tested"),)

    @classmethod
    def version(cls) -> str:
        mod = sys.modules.get("torch_npu")
        return getattr(mod, "__version__", "unknown") if mod is not None else "absent"

    @classmethod
    def _check_availability(cls) -> list[Reason]:
        torch_npu, why = load_torch_npu()
        if torch_npu is None:
            return [Reason(ReasonCode.UNAVAILABLE, why)]
        name, _ = vendor_op(torch_npu)
        if name is None:
            return [Reason(ReasonCode.UNAVAILABLE, f"torch_npu {getattr(torch_npu, '__version__', '?')} has none of "
                                                   f"{', '.join(VENDOR_OPS)}")]
        return []

    @classmethod
    def plan(cls, problem: DecodeProblem, platform, block_table, cache_seqlens, *, softmax_scale: float) -> BackendState:
        torch_npu, _ = load_torch_npu()
        op_name, op = vendor_op(torch_npu)
        state = BackendState(op_name=op_name, op=op)
        cls.update(state, block_table, cache_seqlens, problem=problem)
        return state

    @classmethod
    def update(cls, state: BackendState, block_table, cache_seqlens, *, problem: DecodeProblem | None = None) -> None:
        problem = problem or state.problem
        state.problem = problem
        q_len = problem.q_len
        lens = cache_seqlens.tolist()  # host lists: FIA's actual_seq_kvlen and ATB's context_lens are host data
        per_token = []
        for length in lens:
            for i in range(q_len):
                per_token.append(max(0, length - q_len + 1 + i) if problem.causal else length)
        state.token_lens = per_token
        state.empty_rows = torch.tensor([n == 0 for n in per_token], dtype=torch.bool, device=block_table.device)
        state.block_size = 128 if problem.page_size % 128 == 0 else 16
        cls._refresh_table(state, block_table)

    @staticmethod
    def _refresh_table(state: BackendState, block_table) -> None:
        """The table the NPU ops read (re-paged to ``block_size``, one row per query token), from the block table's
        current values (every run reads them: docs/design.md §2)."""
        problem, block = state.problem, state.block_size
        table = repage_block_table(block_table, problem.page_size, block) if block != problem.page_size else block_table
        state.block_table = table.repeat_interleave(problem.q_len, dim=0).contiguous()

    @classmethod
    def run(cls, state: BackendState, q, kv_cache, block_table, cache_seqlens, *, problem: DecodeProblem,
            softmax_scale, kv_scale, indices, out, lse) -> None:
        cls._refresh_table(state, block_table)
        batch, q_len, heads, dim = q.shape
        tokens = batch * q_len
        heads_p = padded_heads(heads)
        qt = q.reshape(tokens, heads, dim)
        if heads_p != heads:
            qt = torch.cat([qt, qt.new_zeros(tokens, heads_p - heads, dim)], dim=1)
        num_blocks = kv_cache.shape[0] * (problem.page_size // state.block_size)
        kv = kv_cache.reshape(num_blocks, state.block_size, 1, dim)
        if state.op_name == "_npu_paged_attention_mla":
            res = torch.empty(tokens, heads_p, NOPE_DIM, dtype=q.dtype, device=q.device)
            context_lens = torch.tensor(state.token_lens, dtype=torch.int32)  # host tensor, as the op requires
            state.op(query=qt.contiguous(), key_cache=kv, num_kv_heads=1, num_heads=heads_p,
                     scale_value=softmax_scale, block_table=state.block_table, context_lens=context_lens,
                     mla_vheadsize=NOPE_DIM, out=res)
        else:
            q_nope = qt[..., :NOPE_DIM].reshape(tokens, 1, heads_p, NOPE_DIM).contiguous()
            q_rope = qt[..., NOPE_DIM:].reshape(tokens, 1, heads_p, ROPE_DIM).contiguous()
            # [blocks, block_size, H]; the doc requires contiguous key/value, so the interleaved
            # cache is split by copy here (O(cache) traffic per call: a correct, slow fallback).
            k_nope = kv[..., :NOPE_DIM].reshape(num_blocks, state.block_size, NOPE_DIM).contiguous()
            k_rope = kv[..., NOPE_DIM:].reshape(num_blocks, state.block_size, ROPE_DIM).contiguous()
            if state.op_name == "npu_fused_infer_attention_score_v2":
                res, _ = state.op(q_nope, k_nope, k_nope, query_rope=q_rope, key_rope=k_rope,
                                  num_query_heads=heads_p, num_key_value_heads=1, input_layout="BSND",
                                  softmax_scale=softmax_scale, sparse_mode=0, block_table=state.block_table,
                                  block_size=state.block_size, actual_seq_kvlen=state.token_lens)
            else:
                res, _ = state.op(q_nope, k_nope, k_nope, query_rope=q_rope, key_rope=k_rope, num_heads=heads_p,
                                  num_key_value_heads=1, input_layout="BSND", scale=softmax_scale, sparse_mode=0,
                                  block_table=state.block_table, block_size=state.block_size,
                                  actual_seq_lengths_kv=state.token_lens)
            res = res.reshape(tokens, heads_p, NOPE_DIM)
        res = res[:, :heads].masked_fill(state.empty_rows[:, None, None], 0)
        out.copy_(res.reshape(batch, q_len, heads, NOPE_DIM))
