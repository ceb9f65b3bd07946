"""FlashMLA's public API as people call it today, implemented on :func:`mla_dispatch.plan_decode`.

Code written for ``flash_mla`` runs unchanged on every backend mla_dispatch has
(Hopper, other NVIDIA GPUs through Triton, AMD, Ascend, the CPU reference)::

    from mla_dispatch.compat.flash_mla import flash_mla_with_kvcache, get_mla_metadata

    sched_meta, _ = get_mla_metadata()          # one per decode step, shared by all layers
    for layer in layers:
        out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512,
                                          sched_meta, softmax_scale=scale, causal=True)

**Sources.** The contract was read from:

- deepseek-ai/FlashMLA ``flash_mla/flash_mla_interface.py`` and ``tests/ref.py`` at commit 9241ae3 (2026-04-29;
  earlier at 02fe0d0 / 323f076), and at c28eca9 (Sep 2025) for the old metadata convention;
- vLLM 0.33.0 (the PyPI wheel): ``vllm/third_party/flashmla/flash_mla_interface.py``, its bundled copy, which
  adds ``out=`` and ``enable_batch_invariant=`` to ``flash_mla_with_kvcache`` and ``out=`` to
  ``flash_mla_sparse_fwd``, and ``vllm/v1/attention/ops/flashmla.py`` (the dense fp8 call with
  ``descale_q`` / ``descale_k``);
- sgl-flash-mla 1.0.0 (the PyPI wheel, which installs a top-level ``flash_mla``): ``flash_mla/__init__.py``,
  ``flash_mla_interface.py`` and ``_loader.py`` (``use_legacy``, ``kv_format``, ``descale_q``,
  ``descale_k``, ``is_fp8_kvcache=None``, ``get_mla_decoding_metadata``, ``has_legacy``,
  ``return_log2_lse``), the ``kv_format`` names as its legacy extension parses them ("V32", "V32_NO_ROPE",
  "V4", "V41", "V41_FP4"), and sgl-project/FlashMLA's ``csrc`` (sparse decode's ``kv_format``, the dense fp8
  kernel: fp8 q and cache, float32 ``[1]`` descales).

**Metadata conventions.**

- *Current.* ``get_mla_metadata(*args, **kwargs)`` ignores its arguments and returns
  ``(FlashMLASchedMeta(), None)``; the first ``flash_mla_with_kvcache`` call that receives the object fills it
  (here: with a :class:`~mla_dispatch.DecodePlan`), and later calls reuse it. As in FlashMLA, the object may be
  reused only while the shapes and the *values* of ``cache_seqlens`` / ``topk_length`` stay the same: one per
  decode step. Everything else is read on every call, as FlashMLA reads it: another block table, ``softmax_scale``
  or ``head_dim_v`` makes the plan again, the cache and ``indices`` go to each run. ``num_splits`` must be None.
- *Old* (FlashMLA up to Sep 2025, still what older SGLang calls): ``get_mla_metadata(cache_seqlens,
  num_q_tokens_per_head_k, num_heads_k, num_heads_q=None, is_fp8_kvcache=False, topk=None)`` returns two int32
  tensors ``(tile_scheduler_metadata [num_sm_parts, 8], num_splits [b + 1])`` passed back to
  ``flash_mla_with_kvcache``. Here it is :func:`get_mla_metadata_legacy` (and ``get_mla_metadata`` of the
  ``"legacy"`` alias, see below). The tensors hold mla_dispatch's split-KV schedule in FlashMLA's layout;
  ``flash_mla_with_kvcache`` accepts them and plans from ``cache_seqlens`` on each call.
- *sgl-flash-mla's* :func:`get_mla_decoding_metadata` returns the same tensors, to be assigned onto a
  ``FlashMLASchedMeta``.

**The decode call** (:func:`flash_mla_with_kvcache`): FlashMLA's arguments, defaults, shapes and returns
(``q [b, s_q, h_q, d]``, ``k_cache [num_blocks, page_block_size, h_k, d]``, int32 ``block_table`` and
``cache_seqlens``; ``out [b, s_q, h_q, head_dim_v]`` and fp32 ``softmax_lse [b, h_q, s_q]``, natural log,
``+inf`` where a row sees no key). ``softmax_scale`` defaults to ``d ** -0.5``; DeepSeek models need
``1/sqrt(192) * mscale**2``, so pass it. Sparse ``indices``, ``topk_length``, ``attn_sink`` and the ``extra_*``
second cache are supported. Beyond FlashMLA, keyword-only: vLLM's ``out``; sgl-flash-mla's ``use_legacy``,
``kv_format`` (mapped to mla_dispatch's formats), ``descale_k`` (the scale of a per-tensor fp8_e4m3 cache);
``is_fp8_kvcache=None`` infers the cache's kind. Not provided, each raising ``NotImplementedError`` that names
the argument: an fp8 q (``descale_q``) and the DeepSeek-V3.2-no-RoPE / V4.1 and NVFP4 caches. DeepSeek-V4's
584-byte cache (FlashMLA's "MODEL1", d 512) is mla_dispatch's ``fp8_ds_v4``.
``enable_batch_invariant=True`` plans with ``batch_invariant=True`` (each request's result bitwise independent of the
rest of the batch, on the backends that declare it). Any page size works and the dense path runs on any device.

**Prefill** (:mod:`.prefill`): :func:`flash_mla_sparse_fwd` is computed by an fp32 PyTorch reference path
(correct, not fast); ``flash_attn_varlen_func`` and its packed forms (dense MHA prefill) are not provided and
raise ``NotImplementedError`` saying what to use. sgl-flash-mla's MegaAttention (``fused_norm_rope_attn_rope_cast``,
:mod:`.mega`) is there by name, so SGLang's FlashMLA module imports; its functions raise ``NotImplementedError``.

**Making ``import flash_mla`` resolve here** (opt-in; importing mla_dispatch never does it; a real installed
``flash_mla`` is never hidden silently, see :mod:`.alias`):

- in-process: :func:`install_flash_mla_alias` (``api="current"`` or ``"legacy"``);
- one command, unedited: ``python -m mla_dispatch.compat.flash_mla run [--legacy] script.py ARGS``;
- every Python process of an environment (multi-process servers):
  ``python -m mla_dispatch.compat.flash_mla install-pth [--legacy]``, undone with ``uninstall-pth``.

Errors that FlashMLA reports with ``assert`` raise :class:`FlashMLAArgumentError`, which is both a
``ValueError`` and an ``AssertionError``.
"""

from mla_dispatch.compat.flash_mla.errors import FlashMLAArgumentError
from mla_dispatch.compat.flash_mla.metadata import (
    TILE_SCHEDULER_METADATA_SIZE,
    FlashMLASchedMeta,
    get_mla_decoding_metadata,
    get_mla_metadata,
    get_mla_metadata_legacy,
    has_legacy,
)
from mla_dispatch.compat.flash_mla.decode import SGL_KV_FORMATS, flash_mla_with_kvcache
from mla_dispatch.compat.flash_mla.prefill import (
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_mla_sparse_fwd,
)
from mla_dispatch.compat.flash_mla.mega import fused_norm_rope_attn_rope_cast
from mla_dispatch.compat.flash_mla.alias import (
    FlashMLAShadowWarning,
    find_installed_flash_mla,
    install_flash_mla_alias,
    install_pth,
    main,
    uninstall_flash_mla_alias,
    uninstall_pth,
)

__all__ = [
    "FlashMLASchedMeta",
    "FlashMLAArgumentError",
    "FlashMLAShadowWarning",
    "get_mla_metadata",
    "get_mla_metadata_legacy",
    "get_mla_decoding_metadata",
    "has_legacy",
    "flash_mla_with_kvcache",
    "flash_mla_sparse_fwd",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "fused_norm_rope_attn_rope_cast",
    "find_installed_flash_mla",
    "install_flash_mla_alias",
    "uninstall_flash_mla_alias",
    "install_pth",
    "uninstall_pth",
]
