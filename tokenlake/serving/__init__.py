"""Serving: requests in, iterations scheduled by a policy, tokens out.

:class:`~tokenlake.serving.server.Server` runs :class:`GenerationRequest` s greedily on a
cluster (``LocalCluster`` or ``RayCluster``) and its compute engine.
"""

from tokenlake.serving.server import BadRequest, GenerationRequest, RequestResult, Server

__all__ = ["BadRequest", "GenerationRequest", "RequestResult", "Server"]
