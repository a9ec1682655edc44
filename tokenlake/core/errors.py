"""Typed failures of TokenLake.

Every failure a caller can act on has its own type: a full pool is a
:class:`CapacityError`, a prefix that is not in the pool is :class:`PrefixNotCached`,
a dead engine is :class:`EngineUnavailable`. All derive from :class:`TokenLakeError`.
"""

from __future__ import annotations


class TokenLakeError(Exception):
    """Base class of every error raised by TokenLake."""


class ConfigError(TokenLakeError, ValueError):
    """A configuration value is out of range or inconsistent."""


class CapacityError(TokenLakeError):
    """The pool cannot place a segment: every candidate slot is pinned, leased or in use."""


class SegmentNotFound(TokenLakeError, KeyError):
    """A segment key is not (or no longer) in the global prefix tree."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "segment not found"


class PrefixNotCached(TokenLakeError):
    """A batch declares a prefix that the pool does not hold for that request."""


class LeaseError(TokenLakeError):
    """A lease was released twice, or an unknown lease was named."""


class PlanError(TokenLakeError, ValueError):
    """The scheduler's batches or degrees of parallelism cannot be planned."""


class EngineUnavailable(TokenLakeError):
    """A query or transfer engine did not answer in time or has died."""


class NotAuthorized(TokenLakeError):
    """A request that only the cluster's owner may send (``SHUTDOWN``, ``PEERS``) came
    from another process, or a client holds no valid keys for the cluster."""
