"""TokenLake: a cluster-wide, segment-level KV-cache pool for LLM serving.

The package is layered (``docs/design.md`` §2), lowest first: :mod:`tokenlake.core` (the
pure control plane), :mod:`tokenlake.dataplane`, :mod:`tokenlake.model`,
:mod:`tokenlake.generation`, :mod:`tokenlake.deploy`, :mod:`tokenlake.service` and
:mod:`tokenlake.tools`. Importing this package loads none of them: ``tokenlake.connect``
(:func:`tokenlake.service.remote.connect`, the control plane of a served pool) is loaded
on first use.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("tokenlake")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str) -> Any:
    """``tokenlake.connect``, imported on first use (it loads zmq and torch)."""
    if name == "connect":
        from tokenlake.service.remote import connect  # heavy: zmq, torch (the data plane)

        return connect
    raise AttributeError(f"module 'tokenlake' has no attribute {name!r}")


__all__ = ["__version__", "connect"]
