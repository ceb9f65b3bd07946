"""The names mla_dispatch registers with the engines, and the environment switch of the SGLang plugin.

A module of constants only, so the plugin entry points (``plugins.py``) and the backends they load lazily
(``sglang_sparse.py``, ...) can share them without importing each other.
"""

VLLM_BACKEND_CLASS = "mla_dispatch.integrations.vllm.MLADispatchBackend"
VLLM_SPARSE_BACKEND_NAME = "MLA_DISPATCH_SPARSE"
VLLM_SPARSE_BACKEND_CLASS = "mla_dispatch.integrations.vllm_sparse.MLADispatchSparseBackend"
SGLANG_BACKEND_NAME = "mla_dispatch"
SGLANG_DSA_BACKEND_NAME = "mla_dispatch_dsa"
#: environment variable: "1" makes register_sglang() replace SGLang's own "dsa" factory with ours (opt-in)
SGLANG_REPLACE_DSA_ENV = "MLA_DISPATCH_SGLANG_REPLACE_DSA"

__all__ = ["VLLM_BACKEND_CLASS", "VLLM_SPARSE_BACKEND_NAME", "VLLM_SPARSE_BACKEND_CLASS", "SGLANG_BACKEND_NAME",
           "SGLANG_DSA_BACKEND_NAME", "SGLANG_REPLACE_DSA_ENV"]
