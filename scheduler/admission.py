"""Which waiting requests a full pool admits first: cache-first admission.

Admission reserves pool memory for a request's uncached prompt and its output. First
come first served, a full pool gives that memory to whichever request arrived first,
and its new segments evict the prefixes that the requests behind it would have hit: on
a long-document workload the pool then holds a handful of documents, each used by one
question, and every question recomputes its document. A per-instance cache behind a
cache-aware router avoids part of this by accident: questions on one document queue at
the same worker and run one after another over its cached copy.

Cache-first admission makes that grouping deliberate, over the whole pool:

1. **Patience.** A request that has waited longer than its patience is *overdue*:
   overdue requests go first, oldest first, so nobody waits behind cached requests for
   longer than that.
2. **Longest cached prefix first.** Among the others, the request with the most prompt
   tokens ready in the pool goes first (the ``lpm`` queue policy of SGLang's scheduler,
   here over the global tree); ties keep arrival order.
3. **Wait for a prefix in flight.** A request whose next prefix segment an admitted
   request is computing (or, admitted before it in the same pass, will compute) is not
   admitted (within its patience): when that segment is stored it hits it instead of
   computing and storing it a second time. Admission goes on with the requests behind
   it.

``fcfs`` keeps arrival order and admits at once (the former rule, and what the
baselines' workers do), to compare the two.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Iterable
from typing import TypeVar

R = TypeVar("R")

ADMISSION_RULES = ("cache-first", "fcfs")


def check_rule(rule: str) -> str:
    if rule not in ADMISSION_RULES:
        raise ValueError(f"admission must be one of {ADMISSION_RULES}, got {rule!r}")
    return rule


def admission_order(waiting: Iterable[R], cached: Callable[[R], int],
                    overdue: Callable[[R], bool], rule: str = "cache-first") -> list[R]:
    """``waiting`` (in arrival order) in the order they are offered admission:
    overdue ones first, oldest first, then the most ``cached`` prompt tokens first,
    ties in arrival order. ``fcfs`` returns arrival order."""
    reqs = list(waiting)
    if check_rule(rule) == "fcfs":
        return reqs
    return sorted(reqs, key=lambda r: (0, 0) if overdue(r) else (1, -cached(r)))  # stable


def waits_for_flight(next_key: Hashable | None, in_flight: Iterable[Container],
                     overdue: bool, rule: str = "cache-first") -> bool:
    """True if a request should stay waiting because ``next_key`` (its first prefix
    segment not ready yet, or None) is in one of ``in_flight``: the segments admitted
    requests are computing, and those the requests admitted before it in the same pass
    will compute."""
    return (rule == "cache-first" and not overdue and next_key is not None
            and any(next_key in keys for keys in in_flight))
