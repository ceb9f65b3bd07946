"""The vLLM plugin against a real vLLM: import, register through the entry-point
function, resolve the class the way vLLM does. Skipped (with the reason) where
vLLM is not installed; nothing of vLLM is imitated here.

On a GPU with vLLM installed, the end-to-end check is the README command
(``vllm serve ... --attention-backend CUSTOM``).
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install vllm) - the plugin cannot be imported here")


def test_register_and_resolve():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from mla_dispatch.integrations.plugins import VLLM_BACKEND_CLASS, register_vllm

    register_vllm()
    register_vllm()  # plugins load once per process, but must tolerate more
    try:
        assert AttentionBackendEnum.CUSTOM.get_path() == VLLM_BACKEND_CLASS
        cls = AttentionBackendEnum.CUSTOM.get_class()
        from mla_dispatch.integrations.vllm import MLADispatchBackend, MLADispatchImpl, MLADispatchMetadataBuilder, capabilities

        assert cls is MLADispatchBackend and cls.is_mla() and cls.get_name() == "CUSTOM"
        assert cls.get_impl_cls() is MLADispatchImpl and cls.get_builder_cls() is MLADispatchMetadataBuilder
        assert 576 in cls.get_supported_head_sizes()
        caps = capabilities()
        assert all(cls.supports_dtype(d) for d in caps.q_dtypes)
        assert cls.supports_kv_cache_dtype("auto")
        assert cls.supports_block_size(64)
        assert cls.supports_combination(576, caps.q_dtypes[0], "auto", 64, True, False, True, False, None) is not None
        assert callable(MLADispatchImpl.forward_mqa)
    finally:
        AttentionBackendEnum.CUSTOM.clear_override()


def test_entry_point_is_visible_to_vllm():
    """Needs the package installed (pip install -e .) after the entry point was added."""
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    if "mla_dispatch" not in names:
        pytest.skip("no entry point named mla_dispatch: the package is not installed in this environment, or its "
                    "metadata predates the entry point (pip install -e .)")
    assert names["mla_dispatch"] == "mla_dispatch.integrations.plugins:register_vllm"
