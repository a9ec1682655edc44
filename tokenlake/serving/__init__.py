"""Serving: requests in, iterations scheduled by a policy, tokens out.

:class:`~tokenlake.serving.server.Server` runs :class:`GenerationRequest` s greedily on a
cluster (``LocalCluster`` or ``RayCluster``) and its compute engine;
:class:`~tokenlake.serving.tracker.RequestTracker` keeps the live requests' progress and
derives the scheduler's view and the cache-load inputs, for the server and the simulator
alike.

The server needs torch; the tracker must not (the simulator imports it for every run),
so importing this package loads neither: the server's names below are loaded on first
use (PEP 562), and ``tokenlake.serving.tracker`` is imported by its own path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenlake.serving.server import BadRequest, GenerationRequest, RequestResult, Server

__all__ = ["BadRequest", "GenerationRequest", "RequestResult", "Server"]


def __getattr__(name: str):
    if name in __all__:
        # server.py imports torch: load it only when one of its names is asked for.
        import tokenlake.serving.server as server_module

        return getattr(server_module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
