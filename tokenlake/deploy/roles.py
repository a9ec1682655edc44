"""The engine roles of an instance and the code each runs.

Kept apart from the launchers so that they can name roles without importing torch: the
engine modules are imported only when an engine is about to start.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The data-plane engine processes of one instance (= ``tokenlake.engines.loop.ROLES``,
#: not imported here because that module imports torch).
ENGINE_ROLES = ("query", "transfer")


def engine_entry(role: str) -> Callable[[bytes, Any], None]:
    """The process entry point (``main(spec_bytes, conn)``) of an engine role."""
    # Imported here, not at module level: the engine modules import torch, which the
    # launchers' drivers (a Ray driver, `tokenlake serve`) need not load to name a role.
    if role == "query":
        from tokenlake.engines.query import main

        return main
    if role == "transfer":
        from tokenlake.engines.transfer import main

        return main
    raise ValueError(f"role must be one of {ENGINE_ROLES}, got {role!r}")


def engine_class(role: str) -> type:
    """The engine class of a role (built in-process by the Ray engine actors)."""
    # Imported here for the same reason as in engine_entry (torch).
    if role == "query":
        from tokenlake.engines.query import QueryEngine

        return QueryEngine
    if role == "transfer":
        from tokenlake.engines.transfer import TransferEngine

        return TransferEngine
    raise ValueError(f"role must be one of {ENGINE_ROLES}, got {role!r}")
