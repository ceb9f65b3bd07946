"""FlashMLA's public decode API, implemented on :func:`mla_dispatch.plan_decode`.

Code written for ``flash_mla`` runs unchanged on every backend mla_dispatch has
(Hopper, other NVIDIA GPUs through Triton, AMD, Ascend, the CPU reference)::

    from mla_dispatch.compat.flash_mla import flash_mla_with_kvcache, get_mla_metadata

    sched_meta, _ = get_mla_metadata()          # one per decode step, shared by all layers
    for layer in layers:
        out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512,
                                          sched_meta, softmax_scale=scale, causal=True)

The contract implemented is that of deepseek-ai/FlashMLA
``flash_mla/flash_mla_interface.py`` (read at commits 02fe0d0 / 323f076, 2026):

- **Current convention.** ``get_mla_metadata(*args, **kwargs)`` ignores its
  arguments and returns ``(FlashMLASchedMeta(), None)``; the first
  ``flash_mla_with_kvcache`` call that receives the object fills it (here: with a
  :class:`~mla_dispatch.DecodePlan`), and later calls reuse it. As in FlashMLA,
  the object may be reused only while the shapes and the *values* of
  ``cache_seqlens`` / ``topk_length`` stay the same: one per decode step.
  ``num_splits`` must be None.
- **Old convention** (FlashMLA up to Sep 2025, commit c28eca9, still what older
  SGLang calls): ``get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k,
  num_heads_k, num_heads_q=None, is_fp8_kvcache=False, topk=None)`` returns two
  int32 tensors ``(tile_scheduler_metadata [num_sm_parts, 8], num_splits [b + 1])``
  that are passed back to ``flash_mla_with_kvcache``. Here it is
  :func:`get_mla_metadata_legacy` (and ``get_mla_metadata`` of the ``"legacy"``
  alias, see below). The tensors hold mla_dispatch's split-KV schedule in
  FlashMLA's layout; ``flash_mla_with_kvcache`` accepts them and plans from
  ``cache_seqlens`` on each call (no state can ride on plain tensors).

Arguments, defaults, shapes and returns are FlashMLA's: ``q [b, s_q, h_q, d]``,
``k_cache [num_blocks, page_block_size, h_k, d]``, ``block_table [b, max_blocks]``
int32, ``cache_seqlens [b]`` int32; returns ``out [b, s_q, h_q, head_dim_v]`` and
``softmax_lse [b, h_q, s_q]`` fp32 (natural log, ``+inf`` for rows that see no
key). ``softmax_scale`` defaults to ``d ** -0.5`` — DeepSeek models need
``1/sqrt(192) * mscale**2``: pass it. ``is_fp8_kvcache=True`` means DeepSeek's
656-byte token format (``kv_format="fp8_ds_mla"``). Sparse ``indices``,
``topk_length``, ``attn_sink`` and the ``extra_*`` second cache are supported.
Unlike FlashMLA, any page size works and the dense path runs on any device.

Making ``import flash_mla`` resolve here (opt-in; importing mla_dispatch never does it):

- in-process: :func:`install_flash_mla_alias` (``api="current"`` or ``"legacy"``);
- one command, unedited: ``python -m mla_dispatch.compat.flash_mla run [--legacy] script.py ARGS``;
- every Python process of an environment (multi-process servers):
  ``python -m mla_dispatch.compat.flash_mla install-pth [--legacy]``, undone with
  ``uninstall-pth``.

Errors that FlashMLA reports with ``assert`` raise :class:`FlashMLAArgumentError`,
which is both a ``ValueError`` and an ``AssertionError``.
"""

from mla_dispatch.compat.flash_mla.decode import (
    TILE_SCHEDULER_METADATA_SIZE,
    FlashMLAArgumentError,
    FlashMLASchedMeta,
    flash_mla_with_kvcache,
    get_mla_metadata,
    get_mla_metadata_legacy,
)
from mla_dispatch.compat.flash_mla.alias import (
    install_flash_mla_alias,
    install_pth,
    main,
    uninstall_flash_mla_alias,
    uninstall_pth,
)

__all__ = [
    "FlashMLASchedMeta",
    "FlashMLAArgumentError",
    "get_mla_metadata",
    "get_mla_metadata_legacy",
    "flash_mla_with_kvcache",
    "install_flash_mla_alias",
    "uninstall_flash_mla_alias",
]
