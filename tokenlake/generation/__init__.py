"""Generation: requests in, iterations scheduled by a policy, tokens out.

:class:`~tokenlake.generation.loop.GenerationLoop` runs :class:`GenerationRequest` s on a
cluster (``LocalCluster`` or ``RayCluster``) and its compute engine;
:class:`~tokenlake.generation.tracker.RequestTracker` keeps the live requests' progress and
derives the scheduler's view and the cache-load inputs, for the loop and the simulator
alike. (The pool as a service, which runs this loop behind its HTTP API, is
:mod:`tokenlake.service`.)

The loop needs torch; the tracker must not (the simulator imports it for every run), so
importing this package loads neither: the names below are loaded on first use (PEP 562),
and ``tokenlake.generation.tracker`` is imported by its own path.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenlake.generation.loop import GenerationLoop
    from tokenlake.generation.requests import BadRequest, GenerationRequest, RequestResult

__all__ = ["BadRequest", "GenerationLoop", "GenerationRequest", "RequestResult"]
_HOMES = {"GenerationLoop": "loop", "BadRequest": "requests", "GenerationRequest": "requests",
          "RequestResult": "requests"}


def __getattr__(name: str):
    if name in _HOMES:  # both modules import torch: loaded when one of their names is asked for
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
