"""The one request type every workload yields, and the interface of a workload.

A request carries either its exact token ids (ShareGPT, LooGLE, SCBench, synthetic) or,
for traces that publish no tokens (Mooncake FAST'25), the ids of its 512-token prefix
blocks; :meth:`Request.tokens` turns block ids into deterministic stand-in tokens so
that equal blocks give equal tokens and the real prefix tree sees the same sharing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class Request:
    """One request of a workload.

    Attributes:
        request_id: unique within the workload.
        arrival_s: arrival time in seconds from the start of the workload.
        input_length: prompt tokens.
        output_length: tokens to generate.
        token_ids: the prompt's token ids, or None when the workload has only block ids.
        block_hashes: prefix block ids (``block_size`` tokens each, the last one may be
            partial), or None when ``token_ids`` is given.
        block_size: tokens per block of ``block_hashes``.
        session_id: requests of one multi-turn session share it (None: single turn).
        turn: 0-based turn within the session.
    """

    request_id: str
    arrival_s: float
    input_length: int
    output_length: int
    token_ids: tuple[int, ...] | None = None
    block_hashes: tuple[int, ...] | None = None
    block_size: int = 512
    session_id: str | None = None
    turn: int = 0

    def __post_init__(self) -> None:
        if self.input_length < 1 or self.output_length < 1:
            raise ValueError(f"request {self.request_id!r}: lengths must be >= 1")
        if self.arrival_s < 0:
            raise ValueError(f"request {self.request_id!r}: arrival_s must be >= 0")
        if (self.token_ids is None) == (self.block_hashes is None):
            raise ValueError(f"request {self.request_id!r}: give token_ids or block_hashes")
        if self.token_ids is not None and len(self.token_ids) != self.input_length:
            raise ValueError(f"request {self.request_id!r}: {len(self.token_ids)} token ids, "
                             f"input_length {self.input_length}")
        if self.block_hashes is not None:
            need = -(-self.input_length // self.block_size)
            if len(self.block_hashes) != need:
                raise ValueError(f"request {self.request_id!r}: {len(self.block_hashes)} block "
                                 f"ids for {self.input_length} tokens, want {need}")

    def tokens(self) -> tuple[int, ...]:
        """The prompt's token ids; stand-ins derived from the block ids for traces.

        Block ``h`` at position ``i`` within the block becomes token
        ``(h * block_size + i) % 2**31`` -- equal block ids give equal tokens, different
        ids differ (for ids below 2**31 / block_size).
        """
        if self.token_ids is not None:
            return self.token_ids
        bs = self.block_size
        out: list[int] = []
        for h in self.block_hashes:
            base = h * bs
            out.extend((base + i) % 2**31 for i in range(bs))
        return tuple(out[: self.input_length])


class Workload(Protocol):
    """A named, finite, seeded source of requests sorted by arrival time."""

    name: str

    def requests(self) -> Iterator[Request]: ...


@dataclass(frozen=True)
class RequestList:
    """A workload held in memory: a name and its requests, sorted by arrival.

    Every loader of this package returns one; it satisfies :class:`Workload`. The
    constructor checks the order and that request ids are unique.
    """

    name: str
    items: tuple[Request, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "items", tuple(self.items))
        check_requests(self.items, what=f"workload {self.name!r}")

    def requests(self) -> Iterator[Request]:
        """The requests, sorted by arrival time."""
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


def check_requests(requests: Sequence[Request], what: str = "requests") -> None:
    """Raise ValueError unless ``requests`` are sorted by arrival, have unique ids, and
    every session's turns arrive in turn order (turn k+1 strictly after turn k)."""
    seen: set[str] = set()
    last_turn: dict[str, tuple[int, float]] = {}
    prev = 0.0
    for r in requests:
        if r.arrival_s < prev:
            raise ValueError(f"{what}: request {r.request_id!r} arrives at {r.arrival_s} "
                             f"before its predecessor ({prev}): not sorted by arrival")
        prev = r.arrival_s
        if r.request_id in seen:
            raise ValueError(f"{what}: duplicate request id {r.request_id!r}")
        seen.add(r.request_id)
        if r.session_id is not None:
            before = last_turn.get(r.session_id)
            if before is not None and (r.turn <= before[0] or r.arrival_s <= before[1]):
                raise ValueError(f"{what}: session {r.session_id!r} turn {r.turn} does not "
                                 f"come strictly after turn {before[0]}")
            last_turn[r.session_id] = (r.turn, r.arrival_s)


def jsonl_objects(path) -> Iterator[tuple[str, int, dict]]:
    """``(where, lineno, object)`` for every non-blank line of a JSON-lines file, where
    ``where`` is ``"file:line"`` for error messages. A line that is not a JSON object
    raises ``ValueError`` naming it."""

    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON: {e.msg}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object")
            yield where, lineno, obj
