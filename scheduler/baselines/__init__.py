"""Baseline policies the paper compares against (docs/design.md §6), each pure and self-contained.

- :mod:`.cache_aware_router` -- SGLang-Router cache-aware routing.
- :mod:`.round_robin` -- round robin.
- :mod:`.xpyd` -- SGLang + Mooncake xPyD prefill/decode disaggregation (1P3D, 3P1D).
- :mod:`.strict_locality` -- strict-locality segment placement (paper §4.1).
- :mod:`.flowkv` -- FlowKV-style load-aware routing.
- :mod:`.adapter` -- routers as a :class:`scheduler.api.Policy`.
- :mod:`.fixed_pd` -- any :class:`scheduler.api.Policy` (TokenLake) with fixed P:D roles.
- :mod:`.fcfs` -- first-come-first-served with chunked prefill (the serving loop's simplest).

``adapter``, ``fixed_pd`` and ``fcfs`` import :mod:`scheduler.api`; import them by module path.
"""

from .cache_aware_router import CacheAwareRouter
from .flowkv import FlowKVRouter
from .round_robin import RoundRobinRouter
from .strict_locality import PoolFull, StrictLocalityPlacement, place
from .xpyd import KVTransfer, XPyDRouter

__all__ = [
    "CacheAwareRouter",
    "FlowKVRouter",
    "KVTransfer",
    "PoolFull",
    "RoundRobinRouter",
    "StrictLocalityPlacement",
    "XPyDRouter",
    "place",
]
