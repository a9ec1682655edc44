"""Bipartite matching-based dispatching of batches to instances (paper §5.2).

The scheduler decides *what* runs together (batches and their degree of
parallelism, DoP); this module decides *where*. Every batch (or, for DoP > 1,
each of its DoP sub-batches) is a :class:`DispatchNode` that knows how many bytes
it would ship to every instance: query traffic to instances that hold its prefix
segments, and new KV to the instances that will store it. Running the node on
instance ``v`` makes all traffic *to ``v``* local, so the paper's edge weight is

    e(u, v) = -( sum_{k != v} query_bytes[u][k] + sum_{k != v} put_bytes[u][k] )

and the best dispatch is the maximum-weight matching that gives each node its
own instance, solved with the Hungarian-style solver
``scipy.optimize.linear_sum_assignment``.

This module is part of the pure control plane: importing it does not import
numpy or scipy (they are imported inside :func:`dispatch`).
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from tokenlake.core.errors import PlanError

# Instance ids and per-node byte totals must fit the int64 arrays of the cost matrix.
_MAX_INT = 2**62
_ITEMSIZE = array("q").itemsize  # 8 on every supported platform

__all__ = [
    "DispatchNode",
    "communication_bytes",
    "dispatch",
    "edge_weight",
    "split_tokens",
]


def _as_int(value: object, what: str, *, minimum: int = 0, maximum: int = _MAX_INT) -> int:
    """``value`` as a plain ``int`` in ``[minimum, maximum]``; bools, non-integers raise PlanError."""
    if type(value) is int and minimum <= value <= maximum:  # fast path for plain ints
        return value
    if isinstance(value, bool):
        raise PlanError(f"{what} must be an integer, got {value!r}")
    try:
        out = operator.index(value)  # accepts int and numpy integers, rejects floats
    except TypeError:
        raise PlanError(f"{what} must be an integer, got {value!r}") from None
    if not minimum <= out <= maximum:
        raise PlanError(f"{what} must be in [{minimum}, {maximum}], got {out}")
    return out


def _frozen_bytes(mapping: Mapping[int, int], what: str) -> Mapping[int, int]:
    """Validated, read-only copy of an ``instance -> bytes`` mapping, keys in ascending order."""
    if not isinstance(mapping, Mapping):
        raise PlanError(f"{what} must be a mapping instance -> bytes, got {type(mapping).__name__}")
    if all(type(k) is int and type(v) is int and 0 <= k <= _MAX_INT and 0 <= v <= _MAX_INT
           for k, v in mapping.items()):
        items = sorted(mapping.items())  # the common case: plain ints, no message built
    else:
        items = sorted(
            (_as_int(k, f"{what} instance id"), _as_int(v, f"{what}[{k!r}] bytes"))
            for k, v in mapping.items()
        )
    return MappingProxyType(dict(items))


@dataclass(frozen=True)
class DispatchNode:
    """One batch, or one sub-batch of a batch whose DoP > 1 (paper §5.2).

    Byte counts are what the node would move over the network if the named
    instance is *not* the one it runs on; traffic to its own instance is free.
    Both mappings are copied into read-only mappings at construction.
    """

    batch: int
    """Index of the batch in the scheduler's list of batches."""
    part: int
    """Sub-batch index within its batch, ``0 .. dop-1`` (0 for a batch with DoP 1)."""
    query_bytes: Mapping[int, int]
    """Instance id -> bytes of query traffic (query rows out plus partial results
    ``(o, lse)`` back) this node exchanges with that instance. Keys are the paper's Q(u)."""
    put_bytes: Mapping[int, int]
    """Instance id -> bytes of new KV this node stores on that instance
    (``N_p(u, k)`` times the bytes per stored unit). Keys are the paper's P(u)."""
    # Derived, private: the per-instance sum of both kinds of traffic, packed as
    # native int64 arrays (array.array bytes, so no numpy at construction) for a
    # vectorised cost matrix, and its grand total.
    _keys: bytes = field(init=False, repr=False, compare=False)
    _vals: bytes = field(init=False, repr=False, compare=False)
    _total: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch", _as_int(self.batch, "batch"))
        object.__setattr__(self, "part", _as_int(self.part, "part"))
        query = _frozen_bytes(self.query_bytes, "query_bytes")
        put = _frozen_bytes(self.put_bytes, "put_bytes")
        object.__setattr__(self, "query_bytes", query)
        object.__setattr__(self, "put_bytes", put)
        merged = dict(query)
        for k, b in put.items():
            merged[k] = merged.get(k, 0) + b
        traffic = sorted((k, b) for k, b in merged.items() if b)
        total = sum(b for _, b in traffic)
        if total > _MAX_INT:
            raise PlanError(f"node ({self.batch}, {self.part}) moves {total} bytes, over 2**62")
        object.__setattr__(self, "_keys", array("q", [k for k, _ in traffic]).tobytes())
        object.__setattr__(self, "_vals", array("q", [b for _, b in traffic]).tobytes())
        object.__setattr__(self, "_total", total)

    @classmethod
    def from_counts(cls, batch: int, part: int, query_bytes: dict[int, int],
                    put_bytes: dict[int, int]) -> DispatchNode:
        """The same node as the constructor makes, without checking its inputs: for the
        control plane's own counts (plain non-negative ints below 2**62 per entry), on
        the per-iteration path where validation costs more than the rest."""
        node = object.__new__(cls)
        put = object.__setattr__
        put(node, "batch", batch)
        put(node, "part", part)
        put(node, "query_bytes", MappingProxyType(dict(sorted(query_bytes.items()))))
        put(node, "put_bytes", MappingProxyType(dict(sorted(put_bytes.items()))))
        merged = dict(query_bytes)
        for k, b in put_bytes.items():
            merged[k] = merged.get(k, 0) + b
        traffic = sorted(item for item in merged.items() if item[1])
        total = sum(b for _, b in traffic)
        if total > _MAX_INT:
            raise PlanError(f"node ({batch}, {part}) moves {total} bytes, over 2**62")
        put(node, "_keys", array("q", [k for k, _ in traffic]).tobytes())
        put(node, "_vals", array("q", [b for _, b in traffic]).tobytes())
        put(node, "_total", total)
        return node

    def __hash__(self) -> int:  # MappingProxyType is unhashable; hash the sorted items
        return hash(
            (self.batch, self.part, tuple(self.query_bytes.items()), tuple(self.put_bytes.items()))
        )

    @property
    def total_bytes(self) -> int:
        """Bytes moved if every instance the node talks to is remote."""
        return self._total

    def local_bytes(self, instance: int) -> int:
        """Bytes that become local (free) when the node runs on ``instance``."""
        return self.query_bytes.get(instance, 0) + self.put_bytes.get(instance, 0)


def edge_weight(node: DispatchNode, instance: int) -> int:
    """The paper's ``e(u, v)``: minus the bytes ``node`` moves when run on ``instance`` (<= 0)."""
    return -(node.total_bytes - node.local_bytes(instance))


def communication_bytes(nodes: Sequence[DispatchNode], assignment: Sequence[int]) -> int:
    """Total bytes moved over the network when ``nodes[i]`` runs on ``assignment[i]``."""
    if len(nodes) != len(assignment):
        raise PlanError(f"{len(nodes)} nodes but {len(assignment)} assigned instances")
    return sum(-edge_weight(n, v) for n, v in zip(nodes, assignment, strict=True))


def _check_instances(instances: Iterable[int]) -> list[int]:
    ids = [_as_int(v, "instance id") for v in instances]
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        dup = next(v for v in ids if v in seen or seen.add(v))
        raise PlanError(f"instance {dup} appears more than once in instances")
    return ids


def dispatch(nodes: Sequence[DispatchNode], instances: Sequence[int]) -> tuple[int, ...]:
    """Give each node a distinct instance so that total communication bytes are minimal.

    Returns the chosen instance of each node, in node order. The objective is the
    sum of :func:`edge_weight` (maximised), i.e. :func:`communication_bytes`
    (minimised). Instances that nodes mention but that are not in ``instances``
    (e.g. a pool-only instance that runs no batches) are remote for every choice.

    Ties are broken deterministically: the result depends only on the nodes and
    on the *set* of instances, not on the order ``instances`` lists them in.

    Raises :class:`PlanError` if there are more nodes than instances, if
    ``instances`` contains duplicates or non-integer ids, or if a node is not a
    :class:`DispatchNode`. No nodes -> ``()``.
    """
    ids = sorted(_check_instances(instances))
    nodes = list(nodes)
    for n in nodes:
        if not isinstance(n, DispatchNode):
            raise PlanError(f"dispatch expects DispatchNode objects, got {type(n).__name__}")
    if len(nodes) > len(ids):
        raise PlanError(
            f"{len(nodes)} batch/sub-batch nodes but only {len(ids)} instances to run them"
        )
    if not nodes:
        return ()
    cost = _cost_matrix(nodes, ids)
    # Imported here: the core loads without scipy (tests/test_pure_import.py).
    from scipy.optimize import linear_sum_assignment

    _, cols = linear_sum_assignment(cost)  # row indices are 0..n-1 in order as n <= m
    return tuple(ids[c] for c in cols.tolist())


def _cost_matrix(nodes: list[DispatchNode], ids: list[int]):
    """Float64 ``(len(nodes), len(ids))`` matrix with the same optimal matchings as
    ``cost[u, v] = -edge_weight(u, ids[v]) = total_u - bytes_u[ids[v]]``.

    Each node is matched exactly once, so the per-row constant ``total_u`` does
    not change which assignment is optimal; it is left out and the matrix holds
    ``-bytes_u[ids[v]]``, which stays exact in float64 for any realistic byte
    count (up to 2**53 per node and instance) however large the totals are.
    Built in one vectorised scatter from the nodes' packed ``(instance, bytes)``
    pairs; pairs naming instances outside ``ids`` are dropped (remote anyway).
    """
    import numpy as np  # here, not at module level: see linear_sum_assignment above

    n, m = len(nodes), len(ids)
    packed = np.dtype(f"i{_ITEMSIZE}")  # native byte order, as array.array wrote it
    keys = np.frombuffer(b"".join(x._keys for x in nodes), dtype=packed)
    vals = np.frombuffer(b"".join(x._vals for x in nodes), dtype=packed)
    lengths = np.fromiter((len(x._keys) // _ITEMSIZE for x in nodes), dtype=np.int64, count=n)
    rows = np.repeat(np.arange(n), lengths)
    id_arr = np.asarray(ids, dtype=np.int64)  # sorted ascending
    col = np.minimum(np.searchsorted(id_arr, keys), m - 1)
    hit = id_arr[col] == keys
    cost = np.zeros((n, m), dtype=np.float64)
    # (row, instance) pairs are unique (a node's keys are distinct), so a plain
    # fancy-index assignment is exact; no np.add.at needed.
    cost[rows[hit], col[hit]] = -vals[hit]
    return cost


def split_tokens(total_tokens: int, dop: int) -> tuple[tuple[int, int], ...]:
    """Split a batch's new tokens into ``dop`` contiguous ``[start, stop)`` ranges.

    The batch's new tokens are concatenated in batch order and numbered
    ``0 .. total_tokens-1``. Ranges cover them exactly, in order, and differ in
    length by at most one: the first ``total_tokens % dop`` ranges get the extra
    token. Ranges are empty only when ``total_tokens < dop``.

    Raises :class:`PlanError` if ``dop < 1`` or ``total_tokens < 0``.
    """
    total = _as_int(total_tokens, "total_tokens")
    parts = _as_int(dop, "dop", minimum=1)
    base, extra = divmod(total, parts)
    out = []
    start = 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return tuple(out)
