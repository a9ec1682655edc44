"""The transfer engine's entry point under its own name (docs/design.md §1); the engine is
:mod:`tokenlake.engines.transfer`. :func:`main` is the process target the launchers in
:mod:`tokenlake.deploy` start."""

from tokenlake.engines.transfer import TransferEngine, main

__all__ = ["TransferEngine", "main"]
