"""Entry points the engines call to register mla_dispatch (declared in pyproject.toml).

Kept apart from :mod:`~mla_dispatch.integrations.vllm` and
:mod:`~mla_dispatch.integrations.sglang` so that loading a plugin imports only
the engine's small registry module: the backend classes, which import the
engine's attention machinery, load only when the engine selects the backend.
Both functions are idempotent (engines load plugins once per process, in every
process).

- vLLM: group ``vllm.general_plugins`` (``vllm/plugins/__init__.py``,
  ``DEFAULT_PLUGINS_GROUP``); registers the class path under
  ``AttentionBackendEnum.CUSTOM`` (``vllm/v1/attention/backends/registry.py``).
  Select it with ``--attention-backend CUSTOM``; DeepSeek-V3.2's sparse MLA, registered as a
  new name, with ``--attention-backend MLA_DISPATCH_SPARSE``.
- SGLang: group ``sglang.srt.plugins`` (``python/sglang/srt/plugins/__init__.py``,
  ``GENERAL_PLUGINS_GROUP``); adds ``"mla_dispatch"`` to
  ``ATTENTION_BACKENDS`` (``attention_registry.register_attention_backend``) and to
  the CLI's choices (``server_args.add_attention_backend_choices``). Select it
  with ``--attention-backend mla_dispatch``; DeepSeek-V3.2's sparse attention (DSA),
  registered the same way as ``"mla_dispatch_dsa"``, with ``--attention-backend mla_dispatch_dsa``.
  With ``MLA_DISPATCH_SGLANG_REPLACE_DSA=1`` in the environment (opt-in) the DSA backend also
  replaces SGLang's own ``"dsa"`` factory (see :mod:`~mla_dispatch.integrations.sglang_sparse`).
"""

from __future__ import annotations

import os

from mla_dispatch.integrations.names import (SGLANG_BACKEND_NAME, SGLANG_DSA_BACKEND_NAME, SGLANG_REPLACE_DSA_ENV,
                                             VLLM_BACKEND_CLASS, VLLM_SPARSE_BACKEND_CLASS, VLLM_SPARSE_BACKEND_NAME)

__all__ = ["register_vllm", "register_sglang", "VLLM_BACKEND_CLASS", "VLLM_SPARSE_BACKEND_NAME",
           "VLLM_SPARSE_BACKEND_CLASS", "SGLANG_BACKEND_NAME", "SGLANG_DSA_BACKEND_NAME", "SGLANG_REPLACE_DSA_ENV"]


def register_vllm() -> None:
    """Register mla_dispatch's MLA backend as vLLM's ``CUSTOM`` attention backend, and its sparse-MLA backend
    as ``MLA_DISPATCH_SPARSE``."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, VLLM_BACKEND_CLASS)
    existing = getattr(AttentionBackendEnum, "_member_map_", {}).get(VLLM_SPARSE_BACKEND_NAME)
    # a new enum member the first time; the same member's class path after that (registering twice raises)
    register_backend(existing if existing is not None else VLLM_SPARSE_BACKEND_NAME, VLLM_SPARSE_BACKEND_CLASS)


def _create_sglang_backend(model_runner):
    from mla_dispatch.integrations.sglang import MLADispatchAttnBackend

    return MLADispatchAttnBackend(model_runner)


def _create_sglang_dsa_backend(model_runner):
    from mla_dispatch.integrations.sglang_sparse import create_dsa_backend

    return create_dsa_backend(model_runner)


def _create_sglang_dsa_backend_as_dsa(model_runner):
    """SGLang's ``"dsa"`` name served by our DSA backend (opt-in: :data:`SGLANG_REPLACE_DSA_ENV`)."""
    from mla_dispatch.integrations.sglang_sparse import MLADispatchDSABackend

    return MLADispatchDSABackend(model_runner)


def register_sglang() -> None:
    """Register ``--attention-backend mla_dispatch`` and ``mla_dispatch_dsa`` with SGLang; with
    ``MLA_DISPATCH_SGLANG_REPLACE_DSA=1``, also serve SGLang's ``dsa`` name with the latter."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    for name, factory in ((SGLANG_BACKEND_NAME, _create_sglang_backend),
                          (SGLANG_DSA_BACKEND_NAME, _create_sglang_dsa_backend)):
        if name not in ATTENTION_BACKENDS:
            register_attention_backend(name)(factory)
    if os.environ.get(SGLANG_REPLACE_DSA_ENV, "") == "1" and ATTENTION_BACKENDS.get("dsa") is not \
            _create_sglang_dsa_backend_as_dsa:
        register_attention_backend("dsa")(_create_sglang_dsa_backend_as_dsa)
    try:
        from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    except ImportError:  # older SGLang: no CLI whitelist helper; the Python API still works
        return
    new_choices = [n for n in (SGLANG_BACKEND_NAME, SGLANG_DSA_BACKEND_NAME) if n not in ATTENTION_BACKEND_CHOICES]
    if new_choices:
        add_attention_backend_choices(new_choices)
    # --enable-deterministic-inference refuses backends off these lists (sglang/srt/arg_groups/overrides.py; the
    # radix one for absorbed-MLA models, arg_groups/attention_hook.py). Ours then plans batch_invariant=True
    # (integrations/sglang.py, deterministic_inference), and its prefill runs SGLang's own triton backend, which is
    # on both lists. mla_dispatch_dsa is not added: SGLang's dsa, whose prefill it runs, is on neither.
    try:
        from sglang.srt.server_args import (DETERMINISTIC_ATTENTION_BACKEND_CHOICES,
                                            RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND,
                                            add_deterministic_attention_backend_choices,
                                            add_radix_supported_deterministic_attention_backend_choices)
    except ImportError:  # an SGLang without deterministic inference
        return
    if SGLANG_BACKEND_NAME not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        add_deterministic_attention_backend_choices([SGLANG_BACKEND_NAME])
    if SGLANG_BACKEND_NAME not in RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND:
        add_radix_supported_deterministic_attention_backend_choices([SGLANG_BACKEND_NAME])
