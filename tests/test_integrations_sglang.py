"""The SGLang plugin against a real SGLang: import, register through the
entry-point function, find the factory in SGLang's registry and the name among
the CLI's choices. Skipped (with the reason) where SGLang is not installed;
nothing of SGLang is imitated here.

On a GPU with SGLang installed, the end-to-end check is the README command
(``python -m sglang.launch_server ... --attention-backend mla_dispatch``).
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="SGLang is not installed (pip install sglang) - the plugin cannot be imported here")


def test_register_adds_backend_and_cli_choice():
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    from mla_dispatch.integrations.plugins import SGLANG_BACKEND_NAME, register_sglang

    register_sglang()
    register_sglang()  # idempotent
    assert callable(ATTENTION_BACKENDS[SGLANG_BACKEND_NAME])
    try:
        from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES
    except ImportError:
        pytest.skip("this SGLang has no ATTENTION_BACKEND_CHOICES whitelist")
    assert ATTENTION_BACKEND_CHOICES.count(SGLANG_BACKEND_NAME) == 1

    from mla_dispatch.integrations.sglang import MLADispatchAttnBackend
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    assert issubclass(MLADispatchAttnBackend, AttentionBackend)


def test_entry_point_is_visible_to_sglang():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    if "mla_dispatch" not in names:
        pytest.skip("no entry point named mla_dispatch: the package is not installed in this environment, or its "
                    "metadata predates the entry point (pip install -e .)")
    assert names["mla_dispatch"] == "mla_dispatch.integrations.plugins:register_sglang"
