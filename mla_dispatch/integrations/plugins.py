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
  new name, with ``--attention-backend MLA_DISPATCH_SPARSE``, which also selects our DeepSeek-V4 attention
  layer (``vllm/models/deepseek_v4/nvidia/model.py``'s class selector, wrapped when vLLM imports it).
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

import importlib.abc
import os
import sys

from mla_dispatch.integrations.names import (SGLANG_BACKEND_NAME, SGLANG_DSA_BACKEND_NAME, SGLANG_REPLACE_DSA_ENV,
                                             VLLM_BACKEND_CLASS, VLLM_SPARSE_BACKEND_CLASS, VLLM_SPARSE_BACKEND_NAME)

__all__ = ["register_vllm", "register_sglang", "select_dsv4_layers_when_imported", "VLLM_DSV4_MODEL_MODULE",
           "VLLM_BACKEND_CLASS", "VLLM_SPARSE_BACKEND_NAME", "VLLM_SPARSE_BACKEND_CLASS", "SGLANG_BACKEND_NAME",
           "SGLANG_DSA_BACKEND_NAME", "SGLANG_REPLACE_DSA_ENV"]


def register_vllm() -> None:
    """Register mla_dispatch's MLA backend as vLLM's ``CUSTOM`` attention backend, and its sparse-MLA backend
    as ``MLA_DISPATCH_SPARSE``; make that name select our DeepSeek-V4 attention layer too
    (:func:`select_dsv4_layers_when_imported`)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, VLLM_BACKEND_CLASS)
    existing = getattr(AttentionBackendEnum, "_member_map_", {}).get(VLLM_SPARSE_BACKEND_NAME)
    # a new enum member the first time; the same member's class path after that (registering twice raises)
    register_backend(existing if existing is not None else VLLM_SPARSE_BACKEND_NAME, VLLM_SPARSE_BACKEND_CLASS)
    select_dsv4_layers_when_imported()


#: vLLM's CUDA DeepSeek-V4 model module, whose ``_select_dsv4_attn_cls(vllm_config)`` picks the attention layer class
VLLM_DSV4_MODEL_MODULE = "vllm.models.deepseek_v4.nvidia.model"
_DSV4_SELECTOR = "_select_dsv4_attn_cls"


def _wrap_dsv4_selector(module) -> None:
    """Make ``module._select_dsv4_attn_cls`` answer ``MLA_DISPATCH_SPARSE`` with our layer (idempotent)."""
    original = getattr(module, _DSV4_SELECTOR, None)
    if original is None or getattr(original, "mla_dispatch_wrapped", False):
        return  # a vLLM without the selector (nothing to do), or wrapped already

    def select(vllm_config):
        backend = vllm_config.attention_config.backend
        if backend is not None and getattr(backend, "name", None) == VLLM_SPARSE_BACKEND_NAME:
            from mla_dispatch.integrations.vllm_v4 import MLADispatchDeepseekV4Attention

            return MLADispatchDeepseekV4Attention
        return original(vllm_config)

    select.mla_dispatch_wrapped = True
    select.__wrapped__ = original
    select.__doc__ = original.__doc__
    setattr(module, _DSV4_SELECTOR, select)


class _WrapAfterImport(importlib.abc.MetaPathFinder):
    """Finds :data:`VLLM_DSV4_MODEL_MODULE` with the other finders and wraps its selector once it has run."""

    def find_spec(self, name, path=None, target=None):
        if name != VLLM_DSV4_MODEL_MODULE:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, _WrapAfterImport) or not hasattr(finder, "find_spec"):
                continue
            try:
                spec = finder.find_spec(name, path, target)
            except (ImportError, ValueError, AttributeError):  # a finder that cannot answer: ask the next
                continue
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _wrap_dsv4_selector(module)

        spec.loader.exec_module = exec_module  # this spec's own loader object (one per find_spec)
        return spec


def select_dsv4_layers_when_imported() -> None:
    """``--attention-backend MLA_DISPATCH_SPARSE`` on a DeepSeek-V4 model: vLLM 0.33.0's CUDA model module picks the
    attention layer class with its own ``_select_dsv4_attn_cls`` (FlashMLA's or FlashInfer's); this wraps that
    function so that our name selects :class:`mla_dispatch.integrations.vllm_v4.MLADispatchDeepseekV4Attention`
    (other names keep vLLM's answer). Done now if the module is imported, else right after vLLM imports it (a
    finder on ``sys.meta_path``): the plugin does not import vLLM's model code itself. Idempotent."""
    module = sys.modules.get(VLLM_DSV4_MODEL_MODULE)
    if module is not None:
        _wrap_dsv4_selector(module)
    elif not any(isinstance(f, _WrapAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _WrapAfterImport())


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
