"""TokenLake: a cluster-wide, segment-level KV-cache pool for LLM serving.

The package is layered (``docs/design.md`` §2), lowest first: :mod:`tokenlake.core` (the
pure control plane), :mod:`tokenlake.dataplane`, :mod:`tokenlake.model`,
:mod:`tokenlake.serving`, :mod:`tokenlake.deploy` and :mod:`tokenlake.tools`. Importing
this package loads none of them.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tokenlake")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
