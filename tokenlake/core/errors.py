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


class AdoptionRefused(ConfigError):
    """A new control process will not adopt the engines waiting from a dead one: they
    were built with other settings, or their owner still lives (docs/design.md §4
    "Restart"). The message names the difference."""


class CapacityError(TokenLakeError):
    """The pool cannot place a segment: every candidate slot is pinned, leased or in use."""


class SegmentNotFound(TokenLakeError, KeyError):
    """A segment key is not (or no longer) in the global prefix tree."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "segment not found"


class PrefixNotCached(TokenLakeError):
    """A batch declares a prefix that the pool does not hold for that request.
    ``request_ids``: the requests whose prefix it is, where one is named (a serving loop
    matches them again: another client may have evicted what it matched)."""

    def __init__(self, message: str, request_ids: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.request_ids = tuple(request_ids)


class TierCorrupt(TokenLakeError):
    """A segment's file in the disk tier is not what was written (truncated, altered, or
    unreadable): it is refused and removed, never read as the segment."""


class TierReadFailed(TokenLakeError):
    """A promotion that an iteration began to attend while it was read failed before
    one of the layers the iteration needed came in: the iteration did not run (nothing
    of the segment was attended that was not checked); its requests are planned again,
    without the segment."""


class LeaseError(TokenLakeError):
    """A lease was released twice, or an unknown lease was named."""


class PlanError(TokenLakeError, ValueError):
    """The scheduler's batches or degrees of parallelism cannot be planned."""


class EngineUnavailable(TokenLakeError):
    """A query or transfer engine did not answer in time or has died."""


class NotAuthorized(TokenLakeError):
    """A request that only the cluster's owner may send (``SHUTDOWN``, ``PEERS``) came
    from another process, or a client holds no valid keys for the cluster."""


class SessionEnded(NotAuthorized):
    """A client's session on a served pool is not open: never opened, closed, or ended
    by the server because the client stopped heartbeating (docs/security.md). Open a new
    one (a new ``tokenlake.connect``)."""


class SegmentInFlight(PlanError):
    """A request's new tokens complete a segment that another client's iteration is
    still storing: the request cannot be planned now. ``request_ids`` are the requests
    that must wait (plan the rest of the batch without them, and these again once that
    iteration completed, or was aborted and they store the segment themselves)."""

    def __init__(self, message: str, request_ids: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.request_ids = tuple(request_ids)
