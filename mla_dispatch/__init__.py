"""mla_dispatch: one call for the decode step of Multi-head Latent Attention.

>>> out, lse = mla_dispatch.mla_decode(q, kv_cache, block_table, cache_seqlens, softmax_scale=...)

See :func:`mla_decode` for the canonical layout, :func:`plan_decode` for the
plan-once/run-per-layer form, :func:`merge_shards` for merging results computed
on shards of the KV cache (decode context parallelism), and
``python -m mla_dispatch info`` for what runs here.
"""

import logging

from mla_dispatch.api import DecodePlan, auto_candidates, mla_decode, plan_decode
from mla_dispatch.dispatch.backend import CGSupport, MLABackend, Reason, ReasonCode
from mla_dispatch.numerics.tolerance import Tolerance
from mla_dispatch.version import __version__
from mla_dispatch.kvcache.cache import PagedMLACache
from mla_dispatch.metadata.combine import merge_shards
from mla_dispatch.dispatch.platform import Platform, detect_platform
from mla_dispatch.dispatch.problem import DecodeProblem
from mla_dispatch.dispatch.registry import get_backend, register_backend, registered_names
from mla_dispatch.dispatch.select import NoBackendError, SelectionReport, explain, priority, select_backend, use_backends


# Silent by default; enable with logging.getLogger("mla_dispatch").setLevel(logging.INFO) and a handler.
logging.getLogger("mla_dispatch").addHandler(logging.NullHandler())

__all__ = [
    "__version__",
    "auto_candidates",
    "mla_decode",
    "plan_decode",
    "DecodePlan",
    "merge_shards",
    "PagedMLACache",
    "DecodeProblem",
    "Platform",
    "detect_platform",
    "MLABackend",
    "Reason",
    "ReasonCode",
    "CGSupport",
    "Tolerance",
    "register_backend",
    "get_backend",
    "registered_names",
    "priority",
    "select_backend",
    "explain",
    "use_backends",
    "NoBackendError",
    "SelectionReport",
]
