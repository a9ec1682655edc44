"""The query engine's entry point under its own name (docs/design.md §1); the engine is
:mod:`tokenlake.engines.query`. :func:`main` is the process target the launchers in
:mod:`tokenlake.deploy` start."""

from tokenlake.engines.query import QueryEngine, main

__all__ = ["QueryEngine", "main"]
