"""The import hook behind ``--attention-backend MLA_DISPATCH_SPARSE`` on DeepSeek-V4 (plugins.py): it wraps a
module's ``_select_dsv4_attn_cls`` right after the module is imported, or at once if it already was, once. Run
here on a module of the test's own (vLLM is not needed for the mechanics; tests/test_engine_vllm.py runs it on
vLLM's model module). The wrapper's answer for our name imports vLLM, so only the other names are asked here."""

from __future__ import annotations

import sys
import types

import pytest

from mla_dispatch.integrations import plugins

_SOURCE = '''
CALLS = []


def _select_dsv4_attn_cls(vllm_config):
    """vLLM's selector"""
    CALLS.append(vllm_config)
    return "theirs"
'''


@pytest.fixture
def fake_model_module(tmp_path, monkeypatch):
    name = "mla_fake_dsv4_pkg.model"
    pkg = tmp_path / "mla_fake_dsv4_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "VLLM_DSV4_MODEL_MODULE", name)
    before = list(sys.meta_path)
    yield name
    sys.meta_path[:] = before
    for mod in ("mla_fake_dsv4_pkg", name):
        sys.modules.pop(mod, None)


def _config(backend_name):
    return types.SimpleNamespace(attention_config=types.SimpleNamespace(
        backend=None if backend_name is None else types.SimpleNamespace(name=backend_name)))


def test_wraps_after_import_once(fake_model_module):
    plugins.select_dsv4_layers_when_imported()
    plugins.select_dsv4_layers_when_imported()  # one finder, not two
    assert sum(isinstance(f, plugins._WrapAfterImport) for f in sys.meta_path) == 1
    module = __import__(fake_model_module, fromlist=["_select_dsv4_attn_cls"])
    select = module._select_dsv4_attn_cls
    assert select.mla_dispatch_wrapped and select.__doc__ == "vLLM's selector"
    for name in (None, "FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE_DSV4"):
        assert select(_config(name)) == "theirs"
    assert len(module.CALLS) == 3
    plugins.select_dsv4_layers_when_imported()  # now imported: wrapped already, left as it is
    assert module._select_dsv4_attn_cls is select


def test_wraps_an_imported_module_at_once(fake_model_module):
    module = __import__(fake_model_module, fromlist=["_select_dsv4_attn_cls"])
    original = module._select_dsv4_attn_cls
    plugins.select_dsv4_layers_when_imported()
    assert module._select_dsv4_attn_cls.__wrapped__ is original
    assert not any(isinstance(f, plugins._WrapAfterImport) for f in sys.meta_path)


def test_a_module_without_the_selector_is_left_alone(fake_model_module, tmp_path):
    (tmp_path / "mla_fake_dsv4_pkg" / "model.py").write_text("X = 1\n")
    plugins.select_dsv4_layers_when_imported()
    module = __import__(fake_model_module, fromlist=["X"])
    assert module.X == 1 and not hasattr(module, "_select_dsv4_attn_cls")
