"""Hugging Face transformers: DeepSeek-V2/V3 decode attention through mla_dispatch.

Use::

    from transformers import AutoModelForCausalLM
    from mla_dispatch.integrations import transformers as mla_tf

    model = AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16)   # DeepseekV2/V3ForCausalLM
    with mla_tf.enable(model, backend="auto", page_size=64) as handle:
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)
    print(handle.stats, handle.last_backend)

:func:`enable` replaces the ``forward`` of every ``DeepseekV2Attention`` /
``DeepseekV3Attention`` module of a loaded model (an attribute on each module
instance; :meth:`TransformersMLAHandle.disable` deletes it, and the class's own
forward is back). transformers' ``AttentionInterface`` cannot carry this: it is
handed per-head K/V already expanded through ``kv_b_proj``, never the latent
cache.

- **Prefill** (and any step that is not a decode step) runs transformers' own
  forward unchanged. Afterwards the tokens it stored in its cache are copied into
  a paged latent cache of ours: per token ``[kv_a_layernorm(c_kv) (kv_lora_rank)
  | RoPE(k_pe) (qk_rope_head_dim)]``, one KV head, one page pool and one block
  table shared by all layers.
- **Decode** (a cache is present and holds tokens, at most
  ``decode_max_query_len`` new tokens per sequence, none of them masked) runs in
  the absorbed form: ``q_nope`` is multiplied by ``W_UK`` (the key half of
  ``kv_b_proj``) into the latent space, ``q_pe`` gets RoPE, one plan per step
  (shared by all layers; kept across steps of the same batch and table width and
  updated with the step's table and lengths, :meth:`~mla_dispatch.DecodePlan.update`)
  picks the backend, :meth:`~mla_dispatch.DecodePlan.run` attends over the paged latent
  cache with ``softmax_scale = module.scaling`` (DeepSeek: ``1/sqrt(qk_nope +
  qk_rope) * mscale**2`` under YaRN, as the module computed it), and the result
  goes through ``W_UV`` (the value half of ``kv_b_proj``) and ``o_proj``. The new
  tokens' latents are also appended to transformers' cache, which stays complete.

transformers' cache is the source of truth and ours mirrors it: each layer's
cache tensors are checked by identity every step, so a cache that was reordered
(beam search), cropped, replaced or filled while the integration was off is
copied again before it is read. Padding: the model's 2-D ``attention_mask`` says
which tokens are real; padded tokens (left or right) are never copied, so each
sequence's paged cache holds exactly the keys transformers' mask lets it see.

Math and calling contract read from transformers 5.17.0 and 5.24.0
(``models/deepseek_v3/modeling_deepseek_v3.py``: ``DeepseekV3Attention.forward``
caches ``kv_a_layernorm(c_kv)`` and the rotated ``k_pe`` as ``[B, 1, S, D]``
keys/values, ``expand_kv``, ``apply_rotary_pos_emb`` (rotate-half) and
``apply_rotary_pos_emb_interleave`` (``config.rope_interleave``), ``yarn_apply_mscale``;
``models/deepseek_v2/modeling_deepseek_v2.py``: ``apply_rotary_emb`` on complex
``freqs_cis``, no ``q_a_proj`` when ``q_lora_rank`` is None; ``cache_utils.py``:
``DynamicCache`` / ``DynamicLayer`` and its ``reorder_cache`` / ``crop`` replacing
the tensors; ``generation/utils.py``: the 2-D mask and position ids of left-padded
batches; 5.24 renames the attention's ``past_key_values`` argument to ``cache``).
The absorption itself is vLLM's (``vllm/model_executor/layers/attention/mla_attention.py``,
``MLACommonImpl``: ``W_UK_T``/``W_UV`` from ``kv_b_proj``) and SGLang's
(``python/sglang/srt/models/deepseek_v2.py``, ``forward_absorb``).

Supported: ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` (or their
``...Model``) in bfloat16 or float16 with a plain ``nn.Linear`` ``kv_b_proj``, on
one device; transformers' default ``DynamicCache``; a 2-D (or no) attention mask;
inference only (no gradients through the decode path). Anything else raises
ValueError naming the argument: quantised ``kv_b_proj`` weights, a static,
quantised or offloaded cache, a 4-D attention mask. This module imports
transformers only inside :func:`enable`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
import weakref
from collections.abc import Mapping

import torch

from mla_dispatch.api import DecodePlan, plan_decode
from mla_dispatch.integrations.plan_cache import PlanCache

__all__ = ["enable", "TransformersMLAHandle", "SUPPORTED_ATTENTION_CLASSES", "MAX_DECODE_QUERY_LEN"]

#: The attention classes :func:`enable` takes over, by class name -> the RoPE they use.
SUPPORTED_ATTENTION_CLASSES = {"DeepseekV2Attention": "complex", "DeepseekV3Attention": "v3"}

#: The largest ``decode_max_query_len``: our kernels' causal s_q limit (cuda_sm90 and triton take s_q <= 16).
MAX_DECODE_QUERY_LEN = 16

_MODEL_DTYPES = (torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------
# RoPE, the three forms transformers' DeepSeek models use. Each takes x [B, S, h, r] and the
# model's position embeddings for those S positions and returns x rotated, in x's dtype, with the
# same operations in the same order as transformers (so a rotated key equals the one it caches).
# --------------------------------------------------------------------------------------


# Each RoPE variant is a pair: the tables made from the model's position embeddings once per forward (the same object
# reaches every layer; _Step.rope keeps them) and the rotation of a ``[B, S, heads, r]`` tensor with them (q's heads, or
# the key's one). Per layer that leaves the rotation's own ops (four fewer per tensor for the interleaved variant).


def _tables_rotate_half(position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = position_embeddings
    return cos.unsqueeze(2), sin.unsqueeze(2)


def _rope_rotate_half(x: torch.Tensor, tables) -> torch.Tensor:
    """DeepSeek-V3, ``rope_interleave=False``: ``x*cos + rotate_half(x)*sin``; ``cos``, ``sin`` ``[B, S, r]``.

    (modeling_deepseek_v3.py ``apply_rotary_pos_emb``.)
    """
    cos, sin = tables
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def _tables_interleaved(position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = position_embeddings
    half = cos.shape[-1] // 2
    return cos[..., :half].unsqueeze(2), sin[..., :half].unsqueeze(2)


def _rope_interleaved(x: torch.Tensor, tables) -> torch.Tensor:
    """DeepSeek-V3, ``rope_interleave=True``: pairs ``(x[2i], x[2i+1])`` rotated, output de-interleaved.

    The result is ``[even*cos - odd*sin | odd*cos + even*sin]``: keys and queries get the same
    permutation, so their dot products are those of the interleaved pairs
    (modeling_deepseek_v3.py ``apply_rotary_pos_emb_interleave``).
    """
    cos, sin = tables
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def _tables_complex(freqs_cis: torch.Tensor) -> torch.Tensor:
    return freqs_cis.unsqueeze(2)


def _rope_complex(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2: pairs as complex numbers times ``freqs_cis`` (complex ``[B, S, r/2]``), in fp32.

    (modeling_deepseek_v2.py ``apply_rotary_emb``.)
    """
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs_cis.to(pairs.device)).flatten(-2).type_as(x)


# --------------------------------------------------------------------------------------
# The paged latent cache: one block table for all layers, one page tensor per layer
# --------------------------------------------------------------------------------------


#: at most this many new tokens get their slots in plain Python (a decode step's: five torch ops per row otherwise, a
#: few µs each on a GPU host, per step); a prefill's take the vectorised path
_PYTHON_SLOTS = 256


class _LatentPages:
    """Pages of latent tokens for every layer of a model, all layers laid out alike.

    Row ``b``'s token ``j`` sits in block ``blocks[b][j // page_size]`` of every layer's
    ``kv[layer]`` (``[num_blocks, page_size, 1, head_dim]``, the model's dtype), so one block
    table and one plan serve all layers (what vLLM's and SGLang's MLA caches do). The pool
    grows by doubling when it runs out; new pages are NaN, so a slot read before it was
    written would show.
    """

    def __init__(self, layers: list[int], page_size: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.layers = list(layers)
        self.page_size = page_size
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.kv: dict[int, torch.Tensor] = {}
        self.num_blocks = 0
        self._free: list[int] = []
        self.blocks: list[list[int]] = []
        self.lengths: list[int] = []
        self._inputs: tuple[torch.Tensor, torch.Tensor] | None = None

    def reset(self, batch: int) -> None:
        """Forget every row; ``batch`` empty rows. The storage is kept."""
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self.blocks = [[] for _ in range(batch)]
        self.lengths = [0] * batch
        self._inputs = None

    def _grow(self, need: int) -> None:
        new_total = max(2 * self.num_blocks, self.num_blocks + need, 4)
        for layer in self.layers:
            new = torch.full((new_total, self.page_size, 1, self.head_dim), float("nan"), dtype=self.dtype,
                             device=self.device)
            old = self.kv.get(layer)
            if old is not None:
                new[: old.shape[0]].copy_(old)
            self.kv[layer] = new
        # hand out low ids first (pop from the end), old free blocks before new ones
        self._free = list(range(new_total - 1, self.num_blocks - 1, -1)) + self._free
        self.num_blocks = new_total

    def slots(self, starts: list[int], counts: list[int]) -> torch.Tensor:
        """int64 ``[sum(counts)]`` on the device: row ``b``'s tokens ``starts[b] ..`` in row order."""
        ps = self.page_size
        if sum(counts) <= _PYTHON_SLOTS:  # a decode step's few tokens: integer arithmetic, one host tensor
            flat = [blocks[pos // ps] * ps + pos % ps for blocks, start, count in zip(self.blocks, starts, counts)
                    for pos in range(start, start + count)]
            return self._to_device(torch.tensor(flat, dtype=torch.int64))
        parts = []
        for blocks, start, count in zip(self.blocks, starts, counts):
            if count:
                pos = torch.arange(start, start + count)
                table = torch.tensor(blocks, dtype=torch.int64)
                parts.append(table[pos // self.page_size] * self.page_size + pos % self.page_size)
        if not parts:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return self._to_device(torch.cat(parts))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on the pages' device without a host synchronisation: a copy from pageable memory waits for the
        stream's queued work first (dev/integration_profile.py on the H200, 2026-11-29: 3 of the 4 synchronising calls
        the integration added per decode step), one from pinned memory is queued like a kernel (torch's pinned-memory
        cache keeps the staging block until the copy has run)."""
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def reserve(self, counts: list[int]) -> torch.Tensor:
        """Append ``counts[b]`` tokens to each row; returns their slots (see :meth:`slots`)."""
        need = [max(0, -(-(n + c) // self.page_size) - len(b)) for b, n, c in zip(self.blocks, self.lengths, counts)]
        if sum(need) > len(self._free):
            self._grow(sum(need) - len(self._free))
        for blocks, n in zip(self.blocks, need):
            for _ in range(n):
                blocks.append(self._free.pop())
        starts = list(self.lengths)
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]
        self._inputs = None
        return self.slots(starts, counts)

    def write(self, layer: int, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Store ``tokens`` ``[n, head_dim]`` at ``slots`` of ``layer``'s pages (no host synchronisation)."""
        flat = self.kv[layer].view(-1, self.head_dim)
        flat.index_copy_(0, slots, tokens.reshape(-1, self.head_dim).to(self.dtype))

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_table int32 [B, max_blocks], cache_seqlens int32 [B])`` on the device, for the current rows."""
        if self._inputs is None:
            width = max([len(b) for b in self.blocks] + [1])
            rows = [blocks + [0] * (width - len(blocks)) for blocks in self.blocks]
            table = torch.tensor(rows, dtype=torch.int32) if rows else torch.zeros(0, width, dtype=torch.int32)
            lens = torch.tensor(self.lengths, dtype=torch.int32)
            self._inputs = (self._to_device(table), self._to_device(lens))
        return self._inputs


# --------------------------------------------------------------------------------------
# The handle
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Step:
    """One forward of the model: what its first attention layer decided for all the others."""

    mask: torch.Tensor | None  # the model's 2-D attention mask [B, past + new] (None: every token is real)
    mask_error: str | None = None  # why the model's mask cannot be used (checked only where a cache needs it)
    started: bool = False
    past: int = 0  # tokens in transformers' cache before this step
    batch: int = 0
    query_len: int = 0
    decode: bool = False
    new_slots: torch.Tensor | None = None  # our slots of this step's real new tokens, in row order
    new_select: torch.Tensor | None = None  # bool [B, S]: which new tokens are real (None: all of them)
    past_lengths: list[int] | None = None  # each row's real past tokens
    past_slots: torch.Tensor | None = None  # their slots (made when a layer must be copied again)
    past_select: torch.Tensor | None = None  # bool [B, past]: which cached tokens are real (None: all of them)
    plans: dict = dataclasses.field(default_factory=dict)  # softmax_scale -> DecodePlan
    rope: tuple | None = None  # (position embeddings, table maker, tables): RoPE tables made once per forward
    serial: int = 0  # the handle's count of forwards when this one began


@dataclasses.dataclass
class _GraphInputs:
    """What every layer's CUDA graph reads besides its hidden states: copies of a forward's RoPE tables and its new
    tokens' slots, rewritten (in place) once per forward."""

    key: tuple  # (batch, new tokens, table form and shapes): other values need other copies (and other graphs)
    tables: tuple  # the tables' copies (one tensor for DeepSeek-V2's complex form, cos and sin otherwise)
    slots: torch.Tensor
    tuple_form: bool
    serial: int  # the forward whose values they hold

    def as_rope_tables(self):
        return self.tables if self.tuple_form else self.tables[0]


@dataclasses.dataclass
class _LayerGraph:
    """One attention layer's decode captured in a CUDA graph, valid for one plan, one page tensor and one set of
    inputs; ``hidden`` is its input, rewritten before each replay, ``outputs`` its ``(o, c_kv, k_pe)``."""

    graph: torch.cuda.CUDAGraph
    plan: DecodePlan
    kv: torch.Tensor
    inputs: _GraphInputs
    hidden: torch.Tensor
    outputs: tuple


@dataclasses.dataclass
class _LayerRecord:
    epoch: int
    keys: weakref.ref  # transformers' cache tensor of this layer after our last look at it


class TransformersMLAHandle:
    """What :func:`enable` did to a model, and the paged latent cache its decode steps read.

    Attributes
    ----------
    model : torch.nn.Module
        The model given to :func:`enable`.
    backend : str
        The backend requested (``"auto"`` or a name); :attr:`last_backend` says which one ran.
    last_plan : DecodePlan or None
        The plan of the last decode step (its ``backend``, ``softmax_scale``, ``problem``).
    page_size, decode_max_query_len : int
    stats : dict
        Counters: ``decode_steps`` (model forwards whose attention went through mla_dispatch),
        ``other_steps`` (forwards with a cache that ran transformers' attention: prefill, long
        chunks, masked new tokens), ``cache_copies`` (times transformers' cache was copied into
        ours in full, e.g. after a beam-search reorder or a crop), ``plans_made``, and with
        ``cuda_graphs`` ``graph_captures`` / ``graph_replays`` (attention layers captured / replayed).
    cuda_graphs : bool
        Whether decode steps replay each attention layer's CUDA graph (:func:`enable`); turned off,
        with a warning, if a capture fails.
    """

    def __init__(self, model, base_model, attentions, *, backend: str, page_size: int, decode_max_query_len: int,
                 backend_options: Mapping[str, object] | None, dynamic_cache_cls, dynamic_layer_cls,
                 cuda_graphs: bool = False):
        self.model = model
        self.backend = backend
        self.page_size = page_size
        self.decode_max_query_len = decode_max_query_len
        self.backend_options = dict(backend_options) if backend_options else None
        self.cuda_graphs = cuda_graphs
        self.stats = {"decode_steps": 0, "other_steps": 0, "cache_copies": 0, "plans_made": 0}
        if cuda_graphs:
            self.stats.update(graph_captures=0, graph_replays=0)
        self._graphs: dict[int, _LayerGraph] = {}  # layer -> its captured decode
        self._graph_seen: dict[int, tuple] = {}  # layer -> (plan, pages, inputs) of its last eager decode
        self._graph_inputs: _GraphInputs | None = None
        self._template: torch.Tensor | None = None  # a query of the step's shape, to plan before q exists
        self._serial = 0
        self.last_plan: DecodePlan | None = None
        # decode plans kept per shape across steps: a step of the same batch and table width updates one
        self._plans = PlanCache()
        self._base = base_model
        self._attentions = attentions  # [(module, rope form)]
        self._dynamic_cache_cls = dynamic_cache_cls
        self._dynamic_layer_cls = dynamic_layer_cls
        first = attentions[0][0]
        self._latent_dim = first.kv_lora_rank
        self._head_dim = first.kv_lora_rank + first.qk_rope_head_dim
        self._device = first.kv_b_proj.weight.device
        self._heads = first.num_heads
        self._dtype = first.kv_b_proj.weight.dtype
        self._mask_param = _positional_index(type(base_model).forward, "attention_mask")
        self._step: _Step | None = None
        self._pages: _LatentPages | None = None
        self._cache_ref: weakref.ref | None = None
        self._batch = 0
        self._seen = 0  # positions of transformers' cache mirrored in ours
        self._epoch = 0
        self._layers: dict[int, _LayerRecord] = {}
        self._hooks: list = []
        self._enabled = False

    # -- install / remove ------------------------------------------------------------

    def _install(self) -> None:
        for module, rope in self._attentions:
            module.forward = _make_forward(self, module, rope)
        self._hooks = [
            self._base.register_forward_pre_hook(self._begin_step, with_kwargs=True),
            self._base.register_forward_hook(self._end_step, with_kwargs=True, always_call=True),
        ]
        self._enabled = True

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def last_backend(self) -> str | None:
        """The backend of the last decode step's plan (None before the first decode step)."""
        return None if self.last_plan is None else self.last_plan.backend

    def disable(self) -> None:
        """Give every attention module its class's forward back and drop the paged cache.

        transformers' own cache is complete at every step, so a generation can go on
        with stock attention after this. Calling it twice does nothing.

        Raises
        ------
        RuntimeError
            Something replaced an attention module's ``forward`` after :func:`enable`
            (nothing is changed then: remove that wrapper first).
        """
        if not self._enabled:
            return
        for module, _ in self._attentions:
            current = module.__dict__.get("forward")
            if getattr(current, "_mla_dispatch_handle", None) is not self:
                raise RuntimeError(f"{type(module).__name__} (layer {module.layer_idx}).forward was replaced after "
                                   "mla_dispatch's enable(); remove that wrapper before disable()")
        for module, _ in self._attentions:
            del module.forward
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._pages = None
        self._layers.clear()
        self._cache_ref = None
        self._drop_graphs()
        self._enabled = False

    def __enter__(self) -> "TransformersMLAHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.disable()

    def __repr__(self) -> str:
        state = "enabled" if self._enabled else "disabled"
        graphs = ", cuda_graphs=True" if self.cuda_graphs else ""
        return (f"TransformersMLAHandle({type(self.model).__name__}, backend={self.backend!r}, "
                f"page_size={self.page_size}{graphs}, {len(self._attentions)} layers, {state}, stats={self.stats})")

    # -- what tests and tools may read ---------------------------------------------------

    def latent_cache(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(kv, block_table, cache_seqlens)`` of one layer's paged latent cache.

        ``kv`` is ``[num_blocks, page_size, 1, kv_lora_rank + qk_rope_head_dim]`` in the model's
        dtype, ``block_table`` int32 ``[B, max_blocks]``, ``cache_seqlens`` int32 ``[B]``: the
        arguments :func:`~mla_dispatch.mla_decode` takes. Slots no sequence uses are NaN or stale.

        Raises
        ------
        ValueError
            Nothing is cached yet, or ``layer_idx`` is not one of the model's attention layers.
        """
        if self._pages is None or not self._pages.kv:
            raise ValueError("nothing is cached yet: run the model with use_cache=True first")
        if layer_idx not in self._pages.kv:
            raise ValueError(f"layer_idx={layer_idx} (attention layers: {sorted(self._pages.kv)})")
        table, lens = self._pages.decode_inputs()
        return self._pages.kv[layer_idx], table, lens

    # -- one model forward ---------------------------------------------------------------

    def _begin_step(self, module, args, kwargs) -> None:
        mask = kwargs.get("attention_mask")
        if mask is None and self._mask_param is not None and len(args) > self._mask_param:
            mask = args[self._mask_param]
        error = None
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
            shape = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            error = (f"attention_mask must be the 2-D padding mask [batch, past + new tokens] (or None) for "
                     f"mla_dispatch's decode, got {shape}: a 4-D or custom mask cannot say which cached tokens "
                     "a sequence may see")
            mask = None
        self._serial += 1
        self._step = _Step(mask=mask, mask_error=error, serial=self._serial)

    def _end_step(self, module, args, kwargs, output) -> None:
        self._step = None

    def _check_cache(self, cache) -> None:
        if not isinstance(cache, self._dynamic_cache_cls) or getattr(cache, "offloading", False):
            kind = type(cache).__name__ + (" (offloading)" if getattr(cache, "offloading", False) else "")
            raise ValueError(f"past_key_values (`cache` in newer transformers) must be a transformers DynamicCache "
                             f"without offloading for mla_dispatch's decode, got {kind} (use the default cache: no "
                             "cache_implementation=..., or disable() the integration)")
        for layer in getattr(cache, "layers", ()):
            if type(layer) is not self._dynamic_layer_cls:
                raise ValueError(f"past_key_values holds {type(layer).__name__} layers; mla_dispatch's decode "
                                 f"mirrors {self._dynamic_layer_cls.__name__} only")

    def _start_step(self, step: _Step, cache, past: int, batch: int, query_len: int) -> None:
        """The first attention layer of a forward: sync the bookkeeping, reserve slots, decide decode."""
        if step.mask_error is not None:
            raise ValueError(step.mask_error)
        self._check_cache(cache)
        mask = step.mask
        if mask is not None:
            if mask.shape != (batch, past + query_len):
                raise ValueError(f"attention_mask must be [{batch}, {past + query_len}] (batch, cached + new tokens), "
                                 f"got {list(mask.shape)}")
            real = mask != 0
            counts = torch.stack([real[:, :past].sum(1), real[:, past:].sum(1)]).tolist()  # one host sync
            past_counts, new_counts = counts
            new_select = None if all(c == query_len for c in new_counts) else real[:, past:]
        else:
            real = None
            past_counts, new_counts, new_select = [past] * batch, [query_len] * batch, None
        if self._pages is None:
            self._pages = _LatentPages([m.layer_idx for m, _ in self._attentions], self.page_size, self._head_dim,
                                       self._dtype, self._device)
        first_layer = self._attentions[0][0].layer_idx
        record = self._layers.get(first_layer)
        layer_tensors = cache.layers[first_layer].keys if first_layer < len(cache.layers) else None
        in_sync = (self._cache_ref is not None and self._cache_ref() is cache and self._batch == batch
                   and self._seen == past and self._pages.lengths == past_counts
                   and (past == 0 or (record is not None and record.epoch == self._epoch
                                      and record.keys() is layer_tensors)))
        step.past_lengths = past_counts
        if not in_sync:
            # a new cache, a new batch, or transformers' cache changed behind our back: copy it all again
            self._epoch += 1
            self._cache_ref = weakref.ref(cache)
            self._batch = batch
            self._pages.reset(batch)
            if past > 0:
                self.stats["cache_copies"] += 1
                step.past_slots = self._pages.reserve(past_counts)
        step.new_slots = self._pages.reserve(new_counts)
        step.new_select = new_select
        step.past, step.batch, step.query_len = past, batch, query_len
        step.past_select = None if real is None or all(c == past for c in past_counts) else real[:, :past]
        step.decode = past > 0 and query_len <= self.decode_max_query_len and new_select is None
        self._seen = past + query_len
        step.started = True
        self.stats["decode_steps" if step.decode else "other_steps"] += 1

    def _sync_layer(self, step: _Step, cache, layer_idx: int) -> None:
        """Copy this layer's cached tokens into our pages if they are not there (before this step's update)."""
        record = self._layers.get(layer_idx)
        layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
        keys = None if layer is None else layer.keys
        if record is not None and record.epoch == self._epoch and record.keys() is keys:
            return
        if step.past == 0:
            return
        if layer is None or layer.get_seq_length() != step.past:
            raise RuntimeError(f"transformers' cache holds {0 if layer is None else layer.get_seq_length()} tokens "
                               f"for layer {layer_idx} but {step.past} for the first layer of this forward")
        if step.past_slots is None:
            step.past_slots = self._pages.slots([0] * step.batch, step.past_lengths)
        latents = torch.cat([layer.keys[:, 0, : step.past], layer.values[:, 0, : step.past]], dim=-1)
        if step.past_select is not None:
            latents = latents[step.past_select]
        self._pages.write(layer_idx, step.past_slots, latents)

    def _record_layer(self, cache, layer_idx: int) -> None:
        self._layers[layer_idx] = _LayerRecord(self._epoch, weakref.ref(cache.layers[layer_idx].keys))

    def _store_new(self, step: _Step, layer_idx: int, latents: torch.Tensor) -> None:
        """This step's new tokens of one layer, ``[B, S, head_dim]``, into our pages (real ones only)."""
        if step.new_select is not None:
            latents = latents[step.new_select]
        self._pages.write(layer_idx, step.new_slots, latents)

    def _plan(self, step: _Step, q: torch.Tensor, kv: torch.Tensor, softmax_scale: float) -> DecodePlan:
        """The step's plan (one per softmax scale, shared by the layers): the plan kept for these shapes, updated with
        this step's table and lengths (``DecodePlan.update``), or a new one (a new batch, a wider table)."""
        plan = step.plans.get(softmax_scale)
        if plan is None:
            table, lens = self._pages.decode_inputs()

            def make() -> DecodePlan:
                self.stats["plans_made"] += 1
                return plan_decode(q, kv, table, lens, head_dim_v=self._latent_dim, softmax_scale=softmax_scale,
                                   causal=step.query_len > 1, return_lse=False, backend=self.backend,
                                   backend_options=self.backend_options)

            key = (softmax_scale, tuple(q.shape), q.dtype, tuple(kv.shape[1:]), kv.dtype, tuple(table.shape), q.device)
            plan = self._plans.get(key, make, q.device,
                                   reuse=lambda kept: kept.update(block_table=table, cache_seqlens=lens))
            step.plans[softmax_scale] = plan
            self.last_plan = plan
        return plan

    # -- CUDA graphs of the attention layers (enable(cuda_graphs=True)) -------------------------

    def _query_template(self, batch: int, query_len: int) -> torch.Tensor:
        """A query tensor of the step's shape (uninitialised): what a plan is made from before the layer's q exists."""
        t = self._template
        if t is None or t.shape[:2] != (batch, query_len):
            t = self._template = torch.empty(batch, query_len, self._heads, self._head_dim, dtype=self._dtype,
                                             device=self._device)
        return t

    def _inputs_for(self, step: _Step) -> _GraphInputs:
        """The graphs' shared inputs holding this forward's RoPE tables and new slots (copied once per forward)."""
        inputs = self._graph_inputs
        if inputs is not None and inputs.serial == step.serial:  # this forward's first layer filled them
            return inputs
        tables = step.rope[2]
        tuple_form = isinstance(tables, tuple)
        parts = tables if tuple_form else (tables,)
        key = (step.batch, step.query_len, tuple_form, tuple((tuple(t.shape), t.dtype) for t in parts),
               tuple(step.new_slots.shape))
        if inputs is None or inputs.key != key:
            inputs = self._graph_inputs = _GraphInputs(key, tuple(t.clone() for t in parts), step.new_slots.clone(),
                                                       tuple_form, step.serial)
        else:
            for dst, src in zip(inputs.tables, parts):
                dst.copy_(src)
            inputs.slots.copy_(step.new_slots)
            inputs.serial = step.serial
        return inputs

    def _layer_graph(self, step: _Step, module, rotate, hidden_states: torch.Tensor, plan: DecodePlan,
                     kv: torch.Tensor) -> _LayerGraph | None:
        """The layer's decode replayed from its CUDA graph (its outputs then hold this step's values), or None: run it
        eagerly. A layer's graph is captured on its second decode with the same plan, pages and inputs (the first
        runs eagerly: kernels compile and load outside any capture) and replayed while they stay; a plan made anew
        (a new batch, a wider block table), grown pages or new input shapes mean a new capture."""
        layer = module.layer_idx
        inputs = self._inputs_for(step)
        record = self._graphs.get(layer)
        if record is not None:
            if record.plan is plan and record.kv is kv and record.inputs is inputs:
                record.hidden.copy_(hidden_states)
                record.graph.replay()
                self.stats["graph_replays"] += 1
                return record
            del self._graphs[layer]  # stale: let its plan and pages go
        sighting = (plan, kv, inputs)
        seen = self._graph_seen.get(layer)
        if seen is None or any(a is not b for a, b in zip(seen, sighting)):
            self._graph_seen[layer] = sighting
            return None
        del self._graph_seen[layer]
        hidden = hidden_states.clone()
        from mla_dispatch.metadata.launch_graphs import capture_graph

        try:
            graph, outputs = capture_graph(
                lambda: _absorbed_layer(self, step, module, rotate, hidden, inputs.as_rope_tables(), inputs.slots, kv),
                kv.device.index)
        except Exception as exc:  # noqa: BLE001 (an op that cannot be captured: eager from now on, as before)
            warnings.warn(f"mla_dispatch's transformers integration could not capture layer {layer}'s decode in a CUDA "
                          f"graph ({type(exc).__name__}: {exc}); decode steps run eagerly from now on",
                          RuntimeWarning, stacklevel=4)
            self.cuda_graphs = False
            self._drop_graphs()
            return None
        record = self._graphs[layer] = _LayerGraph(graph, plan, kv, inputs, hidden, outputs)
        graph.replay()
        self.stats["graph_captures"] += 1
        self.stats["graph_replays"] += 1
        return record

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        self._graph_seen.clear()
        self._graph_inputs = None


# --------------------------------------------------------------------------------------
# The attention forward
# --------------------------------------------------------------------------------------


def _positional_index(function, name: str) -> int | None:
    """Index of parameter ``name`` among ``function``'s positional arguments after ``self`` (None: keyword only)."""
    params = [p for p in inspect.signature(function).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = [p.name for p in params][1:]
    return names.index(name) if name in names else None


def _call_arguments(names: list[str], args: tuple, kwargs: dict) -> dict:
    """The attention forward's named arguments (positional ones mapped through the class's signature)."""
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _make_forward(handle: TransformersMLAHandle, module, rope: str):
    """``module``'s replacement forward: decode steps through mla_dispatch, everything else stock."""
    stock = type(module).forward.__get__(module)
    names = [p.name for p in inspect.signature(type(module).forward).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
    layer_idx = module.layer_idx
    if rope == "complex":
        apply_rope = (_tables_complex, _rope_complex)
    elif module.config.rope_interleave:
        apply_rope = (_tables_interleaved, _rope_interleaved)
    else:
        apply_rope = (_tables_rotate_half, _rope_rotate_half)

    def forward(*args, **kwargs):
        step = handle._step
        call = _call_arguments(names, args, kwargs)
        cache = call.get("cache", call.get("past_key_values"))  # 5.24 names it `cache`, 5.17 `past_key_values`
        if step is None or cache is None:
            # outside a forward of the enabled model, or without a cache: nothing to mirror, stock attention
            return stock(*args, **kwargs)
        hidden_states = call["hidden_states"]
        batch, query_len = hidden_states.shape[:2]
        past = cache.get_seq_length(layer_idx)
        if not step.started:
            handle._start_step(step, cache, past, batch, query_len)
        elif past != step.past or batch != step.batch or query_len != step.query_len:
            raise RuntimeError(f"layer {layer_idx} sees {past} cached + {query_len} new tokens for {batch} sequences, "
                               f"the first layer of this forward saw {step.past} + {step.query_len} for {step.batch}")
        handle._sync_layer(step, cache, layer_idx)
        if step.decode:
            result = _absorbed_decode(handle, step, module, apply_rope, cache, hidden_states,
                                      call["position_embeddings"])
        else:
            result = stock(*args, **kwargs)
            layer = cache.layers[layer_idx]
            new = torch.cat([layer.keys[:, 0, past: past + query_len], layer.values[:, 0, past: past + query_len]],
                            dim=-1)
            handle._store_new(step, layer_idx, new)
        handle._record_layer(cache, layer_idx)
        return result

    forward._mla_dispatch_handle = handle
    return forward


def _absorbed_decode(handle: TransformersMLAHandle, step: _Step, module, apply_rope, cache,
                     hidden_states: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, None]:
    """One layer's decode attention in the absorbed form (:func:`_absorbed_layer`), eager or as the layer's CUDA graph
    (``enable(cuda_graphs=True)``: :meth:`TransformersMLAHandle._layer_graph`); the new tokens' latents are appended to
    transformers' cache (outside any graph: its cache grows by concatenation). Returns ``(o_proj output [B, S,
    hidden], None)``."""
    batch, query_len = hidden_states.shape[:2]
    tables_of, rotate = apply_rope
    if step.rope is None or step.rope[0] is not position_embeddings or step.rope[1] is not tables_of:
        step.rope = (position_embeddings, tables_of, tables_of(position_embeddings))  # the forward's first layer
    layer_idx = module.layer_idx
    kv = handle._pages.kv[layer_idx]
    record = None
    if handle.cuda_graphs and kv.is_cuda and not torch.cuda.is_current_stream_capturing():
        plan = handle._plan(step, handle._query_template(batch, query_len), kv, float(module.scaling))
        record = handle._layer_graph(step, module, rotate, hidden_states, plan, kv)
    if record is not None:
        o, c_kv, k_pe = record.outputs
    else:
        o, c_kv, k_pe = _absorbed_layer(handle, step, module, rotate, hidden_states, step.rope[2], step.new_slots, kv)
    # transformers' cache stays complete (its layout: [B, 1, S, D]); ours got the same tokens (_absorbed_layer)
    cache.update(c_kv.unsqueeze(1), k_pe.unsqueeze(1), layer_idx)
    return o, None


def _absorbed_layer(handle: TransformersMLAHandle, step: _Step, module, rotate, hidden_states: torch.Tensor, tables,
                    new_slots: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's decode attention on the device, nothing on the host that a CUDA graph could not hold: returns
    ``(o_proj output [B, S, hidden], c_kv [B, S, L], rotated k_pe [B, S, r])`` and writes the new tokens' latents to
    our pages at ``new_slots``.

    Shapes (H heads, n = qk_nope_head_dim, r = qk_rope_head_dim, L = kv_lora_rank, v = v_head_dim)::

        q          [B, S, H, n + r]   q_proj, or q_b_proj(q_a_layernorm(q_a_proj(x)))
        W          [H, n + v, L]      kv_b_proj.weight viewed per head: W_UK = W[:, :n], W_UV = W[:, n:]
        q_latent   [B, S, H, L]       q_nope @ W_UK            (the key's up-projection moved onto q)
        query      [B, S, H, L + r]   [q_latent | RoPE(q_pe)]  what mla_dispatch attends with
        out        [B, S, H, L]       softmax(scale * query . [c_kv | k_pe]) @ c_kv
        o          [B, S, H * v]      out @ W_UV^T, then o_proj
    """
    batch, query_len = hidden_states.shape[:2]
    heads, nope, rope_dim = module.num_heads, module.qk_nope_head_dim, module.qk_rope_head_dim
    latent, v_dim = module.kv_lora_rank, module.v_head_dim
    if module.q_lora_rank is None:
        q = module.q_proj(hidden_states)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    q = q.view(batch, query_len, heads, nope + rope_dim)
    q_nope, q_pe = torch.split(q, [nope, rope_dim], dim=-1)

    compressed = module.kv_a_proj_with_mqa(hidden_states)
    c_kv, k_pe = torch.split(compressed, [latent, rope_dim], dim=-1)
    c_kv = module.kv_a_layernorm(c_kv)  # [B, S, L]
    q_pe = rotate(q_pe, tables)  # [B, S, H, r]
    k_pe = rotate(k_pe.unsqueeze(2), tables).squeeze(2)  # [B, S, r]
    handle._pages.write(module.layer_idx, new_slots, torch.cat([c_kv, k_pe], dim=-1))  # (decode: every token real)

    w = module.kv_b_proj.weight.view(heads, nope + v_dim, latent)
    q_latent = torch.bmm(q_nope.reshape(batch * query_len, heads, nope).transpose(0, 1), w[:, :nope])  # [H, BS, L]
    query = torch.cat([q_latent.transpose(0, 1).reshape(batch, query_len, heads, latent), q_pe], dim=-1)

    plan = handle._plan(step, query, kv, float(module.scaling))
    out, _ = plan.run(query, kv)  # [B, S, H, L]

    o = torch.bmm(out.reshape(batch * query_len, heads, latent).transpose(0, 1), w[:, nope:].transpose(1, 2))
    o = o.transpose(0, 1).reshape(batch, query_len, heads * v_dim)
    return module.o_proj(o), c_kv, k_pe


# --------------------------------------------------------------------------------------
# enable()
# --------------------------------------------------------------------------------------


def enable(model, *, backend: str = "auto", page_size: int = 64, decode_max_query_len: int = 1,
           backend_options: Mapping[str, object] | None = None, cuda_graphs: bool = False) -> TransformersMLAHandle:
    """Route a DeepSeek-V2/V3 model's decode attention through mla_dispatch.

    Parameters
    ----------
    model : DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, DeepseekV2Model or DeepseekV3Model
        A loaded transformers model in bfloat16 or float16, every attention layer on one device.
        Move or cast it before enabling: the paged cache takes the device and dtype it has now.
    backend : str
        ``"auto"`` (the best backend here) or a registered name (``python -m mla_dispatch info``).
        A named backend that cannot run the model's decode raises here, never later.
    page_size : int
        Tokens per page of the paged latent cache (>= 1; FlashMLA's kernel needs 64).
    decode_max_query_len : int
        A forward with a cache and at most this many new tokens per sequence (1 ..
        :data:`MAX_DECODE_QUERY_LEN`) is a decode step; more new tokens run transformers'
        attention. Above 1, decode is causal (token ``i`` of ``S`` sees the cache up to itself).
    backend_options : Mapping, optional
        Passed to :func:`~mla_dispatch.plan_decode` (needs a named ``backend``).
    cuda_graphs : bool
        Replay each attention layer's decode from a CUDA graph (a model on a CUDA device): the
        layer's ~90 operations become one copy of its input and one graph launch, so a decode step's
        host time no longer grows with them. A layer is captured on its second decode step with
        the same plan (plans are kept per batch and block-table width, so a generation recaptures
        each time its table grows by a page) and replayed while the plan, our pages and the step's
        shapes stay; transformers' own cache is still appended outside the graph. A capture that
        fails turns this off with a RuntimeWarning (decode then runs eagerly, as without it).

    Returns
    -------
    TransformersMLAHandle
        ``disable()`` (or leaving a ``with`` block) restores stock attention.

    Raises
    ------
    ValueError
        ``model`` is not a supported DeepSeek model, is not bfloat16/float16, is spread over
        several devices, has a ``kv_b_proj`` that is not a plain floating-point ``nn.Linear``
        (e.g. quantised), or is already enabled; ``page_size`` or ``decode_max_query_len`` out of
        range; ``backend_options`` without a named backend; ``cuda_graphs=True`` for a model that
        is not on a CUDA device.
    ImportError
        transformers is not installed (``pip install "mla-dispatch[transformers]"``).
    NoBackendError
        No backend here (or not the named one) can run this model's decode problem.
    """
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError as exc:
        raise ImportError(f"mla_dispatch.integrations.transformers needs transformers>=5.17 "
                          f"(pip install 'mla-dispatch[transformers]'): {exc}") from exc
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    if (not isinstance(decode_max_query_len, int) or isinstance(decode_max_query_len, bool)
            or not 1 <= decode_max_query_len <= MAX_DECODE_QUERY_LEN):
        raise ValueError(f"decode_max_query_len must be an int in [1, {MAX_DECODE_QUERY_LEN}], "
                         f"got {decode_max_query_len!r}")
    if not isinstance(backend, str):
        raise ValueError(f"backend must be a string ('auto' or a backend name), got {backend!r}")
    if backend_options and backend == "auto":
        raise ValueError(f"backend_options={dict(backend_options)} need a named backend, not backend='auto'")

    base_model = _base_model(model)
    attentions = [(m, SUPPORTED_ATTENTION_CLASSES[type(m).__name__]) for m in base_model.modules()
                  if type(m).__name__ in SUPPORTED_ATTENTION_CLASSES]
    if not attentions:
        raise ValueError(f"model {type(model).__name__} has no DeepseekV2Attention/DeepseekV3Attention module")
    for module, _ in attentions:
        _check_attention(module, attentions[0][0])

    if not isinstance(cuda_graphs, bool):
        raise ValueError(f"cuda_graphs must be True or False, got {cuda_graphs!r}")
    device = attentions[0][0].kv_b_proj.weight.device
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, it is on {device}")

    handle = TransformersMLAHandle(model, base_model, attentions, backend=backend, page_size=page_size,
                                   decode_max_query_len=decode_max_query_len, backend_options=backend_options,
                                   dynamic_cache_cls=DynamicCache, dynamic_layer_cls=DynamicLayer,
                                   cuda_graphs=cuda_graphs)
    _probe(handle, attentions[0][0])
    handle._install()
    return handle


_MODEL_CLASSES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV2Model", "DeepseekV3Model")


def _base_model(model):
    """The ``DeepseekV{2,3}Model`` whose forward sees the 2-D attention mask."""
    name = type(model).__name__
    if name in ("DeepseekV2Model", "DeepseekV3Model"):
        return model
    if name in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        return model.model
    raise ValueError(f"model must be one of {', '.join(_MODEL_CLASSES)} (transformers' DeepSeek-V2/V3), "
                     f"got {name}")


def _check_attention(module, first) -> None:
    name = f"{type(module).__name__} of layer {module.layer_idx}"
    if "forward" in module.__dict__:
        if getattr(module.__dict__["forward"], "_mla_dispatch_handle", None) is not None:
            raise ValueError(f"model is already enabled ({name}): disable() its handle first")
        raise ValueError(f"model's {name} already has a replaced forward; mla_dispatch would hide it")
    weight = getattr(module.kv_b_proj, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dtype in (torch.float32, torch.float64):
        raise ValueError(f"model must be in bfloat16 or float16 for mla_dispatch's decode kernels, got {weight.dtype} "
                         f"({name}): model.to(torch.bfloat16) first")
    if (type(module.kv_b_proj) is not torch.nn.Linear or module.kv_b_proj.bias is not None
            or not isinstance(weight, torch.Tensor) or weight.dtype not in _MODEL_DTYPES):
        got = f"{type(module.kv_b_proj).__name__} with weight {getattr(weight, 'dtype', None)}"
        raise ValueError(f"model's kv_b_proj must be a torch.nn.Linear without bias in bfloat16 or float16 "
                         f"({name}: {got}); quantised kv_b_proj weights are not supported, dequantise them first")
    if weight.device != first.kv_b_proj.weight.device or weight.dtype != first.kv_b_proj.weight.dtype:
        raise ValueError(f"model must be on one device in one dtype: {name} is {weight.dtype} on {weight.device}, "
                         f"layer {first.layer_idx} {first.kv_b_proj.weight.dtype} on {first.kv_b_proj.weight.device}")
    for attr in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "num_heads"):
        if getattr(module, attr) != getattr(first, attr):
            raise ValueError(f"model's attention layers differ in {attr}: {name} has {getattr(module, attr)}, "
                             f"layer {first.layer_idx} {getattr(first, attr)}")
    if not (isinstance(module.scaling, float) and module.scaling > 0 and math.isfinite(module.scaling)):
        raise ValueError(f"model's {name} has scaling={module.scaling!r} (expected a finite positive float)")


def _probe(handle: TransformersMLAHandle, module) -> None:
    """Plan this model's decode problems now (one new token, and the most), so a backend that cannot run them
    fails in enable() rather than in the middle of a generation."""
    device, dtype = handle._device, handle._dtype
    for query_len in sorted({1, handle.decode_max_query_len}):
        blocks = -(-query_len // handle.page_size)
        kv = torch.zeros(blocks, handle.page_size, 1, handle._head_dim, dtype=dtype, device=device)
        table = torch.arange(blocks, dtype=torch.int32, device=device).unsqueeze(0)
        q = torch.zeros(1, query_len, module.num_heads, handle._head_dim, dtype=dtype, device=device)
        lens = torch.full((1,), query_len, dtype=torch.int32, device=device)
        plan_decode(q, kv, table, lens, head_dim_v=handle._latent_dim, softmax_scale=float(module.scaling),
                    causal=query_len > 1, return_lse=False, backend=handle.backend,
                    backend_options=handle.backend_options)
