"""How a sub-batch's query items are attended, worked out once per plan and used for
every layer: by a query engine over its own and co-located slabs, and by a client on the
pool's machine that attends a plan's slots in place (vLLM's query mode, docs/vllm.md
"Attending in place")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch

from tokenlake.kernels.attention import empty_partial, merge, write_into
from tokenlake.kernels.paged import Group
from tokenlake.kernels.slab import prepare_slabs_attention

#: "0" in a compute engine's environment (vLLM's worker too): every layer's prefix
#: attention is asked of the pool's query engine, even where this process holds or maps
#: every slab the plan reads and could attend it in place.
IN_PLACE_ENV = "TOKENLAKE_QUERY_IN_PLACE"


class Item(Protocol):
    """Rows ``[start, stop)`` over ``slots`` of one slab holding ``tokens`` valid tokens
    each (a wire :class:`~tokenlake.dataplane.messages.AttendItem` or a plan's
    :class:`~tokenlake.core.plans.QueryItem`)."""

    start: int
    stop: int
    slots: tuple[int, ...]
    tokens: tuple[int, ...]


Work = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # slab indices, slots, token counts


@dataclass(frozen=True)
class AttendLayout:
    """How a plan's items are attended (by a query engine, or in place by a compute
    engine), worked out once per plan and reused for every layer.

    An item's slots that several row ranges read alike (the same slots, slabs and token
    counts: a document's segments shared by the requests of a batch) are attended once
    for all those rows together, cascade style (``shared``), so their K/V is read once;
    the rest of each row range (its own segments and open tail, in any of the slabs) in
    one call per range (``own``). On a GPU both kinds go into one batched launch
    (:attr:`paged_groups`): a shared part is one entry over all its rows.
    """

    insts: tuple[int, ...]  # the slabs, by instance (this one's, or co-located peers')
    own: tuple[tuple[int, int, Work], ...]  # (start, stop, work)
    shared: tuple[tuple[slice | torch.Tensor, Work], ...]  # (rows: a slice where they are contiguous, work)
    disjoint: bool  # the own row ranges do not overlap: each is written, not merged
    stop: int  # rows the items need
    # the calls that attend each part, set up at first use for every layer (CPU)
    calls: list = field(default_factory=list, compare=False, repr=False)

    @cached_property
    def paged_groups(self) -> tuple[Group, ...]:
        """The GPU path's groups (one FlashInfer launch, ``kernels.paged``), worked out at
        the first layer and kept for the others: each own
        range, then each shared part as one group over its rows, so the batched prefill
        kernel reads its pages once per tile of query rows rather than once per row
        (FlashInfer's cascade does the same for a shared prefix). Rows of a shared part
        that are not contiguous give one group per run of consecutive rows."""
        groups: list[Group] = [(a, z, w[1], w[2]) for a, z, w in self.own]
        for rows, w in self.shared:
            for a, z in _runs(rows):
                groups.append((a, z, w[1], w[2]))
        return tuple(groups)

    def attend(self, q: torch.Tensor, layer: int, slabs: Sequence[torch.Tensor], q_heads: int,
               out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial attention of rows ``q`` over the items at ``layer`` of CPU ``slabs``
        (those of :attr:`insts`, in that order; rows relative to ``q``): the parts'
        partials merged exactly, a single one over all rows returned as it is. Given
        ``out`` (``o`` and ``lse`` rows), the result is written there (by the kernel itself
        on the csrc path: no copy) and ``out`` is returned."""
        if not self.calls:  # the slot tables, once for every layer; own parts first
            for rows, w, own in [(slice(a, z), w, True) for a, z, w in self.own] + \
                    [(rows, w, False) for rows, w in self.shared]:
                n = len(range(q.shape[0])[rows]) if isinstance(rows, slice) else len(rows)
                # an own part of disjoint ranges is written (nothing else wrote its rows yet)
                self.calls.append((rows, prepare_slabs_attention(n, q_heads, slabs, *w), own and self.disjoint))
        if len(self.calls) == 1 and self.calls[0][0] == slice(0, q.shape[0]):
            return self.calls[0][1](q, layer, out)  # one part over every row: nothing to merge
        o, lse = empty_partial(q.shape[0], q_heads, q.shape[2])
        for rows, call, write in self.calls:
            po, plse = call(q[rows], layer)
            if write:
                o[rows], lse[rows] = po, plse
            else:
                o[rows], lse[rows] = merge(o[rows], lse[rows], po, plse)
        return write_into((o, lse), out)

    @classmethod
    def of(cls, by_slab: dict[int, Sequence[Item]], cascade: bool = True) -> AttendLayout:
        ranges_of: dict[tuple[tuple[int, int, int], ...], set[tuple[int, int]]] = {}  # work -> row ranges
        for k, items in enumerate(by_slab.values()):
            for it in items:
                ranges_of.setdefault(tuple((k, s, t) for s, t in zip(it.slots, it.tokens)), set()).add(
                    (it.start, it.stop))
        own: dict[tuple[int, int], list] = {}
        shared: dict[tuple[tuple[int, int], ...], list] = {}
        for work, ranges in ranges_of.items():
            if len(ranges) == 1 or not cascade:
                for rows in ranges:
                    own.setdefault(rows, []).extend(work)
            else:
                shared.setdefault(tuple(sorted(ranges)), []).extend(work)
        spans = sorted(own)
        return cls(tuple(by_slab),
                   tuple((a, z, tuple(zip(*w))) for (a, z), w in own.items()),
                   tuple((_rows(rs), tuple(zip(*w))) for rs, w in shared.items()),
                   all(a2 >= z1 for (_, z1), (a2, _) in zip(spans, spans[1:])),
                   max((z for rs in ranges_of.values() for _, z in rs), default=0))


def _runs(rows: slice | torch.Tensor) -> list[tuple[int, int]]:
    """Row indices (a slice or ascending indices) as runs of consecutive rows."""
    if isinstance(rows, slice):
        return [(rows.start, rows.stop)]
    runs: list[tuple[int, int]] = []
    for r in rows.tolist():
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


def _rows(ranges: tuple[tuple[int, int], ...]) -> slice | torch.Tensor:
    """Sorted row ranges as one slice where they follow each other (the requests of a
    batch over one document), else as row indices."""
    if all(z == a2 for (_, z), (a2, _) in zip(ranges, ranges[1:])):
        return slice(ranges[0][0], ranges[-1][1])
    return torch.cat([torch.arange(a, z) for a, z in ranges])
