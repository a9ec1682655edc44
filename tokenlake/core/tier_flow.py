"""The control plane's tier calls (:meth:`~tokenlake.core.control.ControlPlane.flush_tier`
and :meth:`~tokenlake.core.control.ControlPlane.promote`): the bookkeeping of
:mod:`tokenlake.core.tier` handed to a :class:`~tokenlake.core.tier.TierDataPlane` and
its answers recorded. Without a data plane (the simulator, the core's tests) every
move counts as done at once."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from tokenlake.core.tier import Promotion, TierDataPlane
from tokenlake.core.tree_nodes import relocate


def flush(pool, data_plane: TierDataPlane | None) -> None:
    """Hands the tiers' queued work (copies to drop, new segments to write through) to
    ``data_plane`` and records what it staged; frees what fenced engines held back."""
    tier = pool.tier
    if tier is None:
        return
    if data_plane is None:
        tier.settle()  # nothing moves data: staged at once
        return
    tier.staged(*data_plane.tier_ops(tier.take_ops()))  # also with none: it reports the fenced
    for instance, epoch in data_plane.fenced().items():
        tier.release(instance, epoch)
    tier.engines = data_plane.counters()


@dataclass
class PromotionBatch:
    """Promotions begun (:func:`begin`) and not yet ended (:func:`end`): the slots are
    taken, pending replicas added, and the prompts' hits in the slabs leased (the
    first promoted segment hangs under the last of them). ``prompts``: the indices of
    the prompts that had something to promote."""

    promos: list[Promotion]
    leased: list[bytes]
    prompts: list[int]
    leased_nodes: list = field(default_factory=list)  # the tree nodes leased (``leased``'s)


def begin(pool, prompts: Iterable[tuple[Sequence[int], str | None]]) -> PromotionBatch | None:
    """Takes slots for what each ``(token ids, cache salt)`` prompt's prefix holds only
    in a tier, parent first (None: nothing to promote). Under the control plane's lock;
    the reads (:meth:`~tokenlake.core.tier.TierDataPlane.tier_read` of ``promos``) need
    not be, and :func:`end` takes their outcome."""
    tier = pool.tier
    batch = PromotionBatch([], [], [])
    try:
        for i, (tokens, salt) in enumerate(prompts):
            m = pool.match(tokens, max_tokens=max(len(tokens) - 1, 0), salt=salt)
            keys = m.tier_keys
            if m.tier_partial and not pool.slots.free_count(pool.tree.node(keys[-1]).tier):
                keys = keys[:-1]  # a page hit's segment only into a free slot: it evicts nothing
            if keys:
                pool.lease(m.keys)
                batch.leased += m.keys
                batch.leased_nodes += [pool.tree.node(k) for k in m.keys]
                promos = tier.promote(keys)
                batch.promos += promos
                if promos:
                    batch.prompts.append(i)
    except BaseException:
        end(pool, batch, None)
        raise
    if not batch.promos:
        end(pool, batch, (set(), {}))
        return None
    return batch


def end(pool, batch: PromotionBatch, outcome: tuple[set[bytes], dict[bytes, int]] | None) -> int:
    """Records the reads' ``outcome`` (the keys that failed, and those of them whose
    engine may still write their slots, with the epoch each was sent at:
    :meth:`~tokenlake.core.tier.TierManager.hold_back`;
    None: nothing was read, the segments are held only in the tier again); returns how
    many came back. Promotions whose segment went meanwhile (its instance left) are
    skipped. :func:`flush` is still to run: the failed ones' copies go."""
    tier = pool.tier
    for p in batch.promos:  # no engine writes their slots any more, or they are held back
        tier.read_over(p, None if outcome is None else outcome[1].get(p.key))
    try:
        if outcome is None:
            for p in reversed(batch.promos):
                tier.unpromote(p)
            return 0
        failed, unanswered = outcome
        for p in batch.promos:  # first: a failed parent's subtree must leave these slots taken
            if p.key in unanswered:
                tier.hold_back(p, unanswered[p.key])
        before = tier.promotions
        for p in batch.promos:  # parent first: a failed parent takes its children along
            (tier.promotion_failed if p.key in failed else tier.promoted)(p)
        return tier.promotions - before
    finally:  # only the very nodes leased: a key that went with its instance may be back
        tree = pool.tree
        pool.unlease([k for k, n in zip(batch.leased, batch.leased_nodes)
                      if k in tree and tree.node(k) is n], missing_ok=True)


@contextlib.contextmanager
def readable(pool, batches: Sequence[PromotionBatch]) -> Iterator[None]:
    """While the block runs (under the control plane's lock), the pending replicas that
    ``batches`` added count as ready: a match finds them and a plan attends them. They
    are leased meanwhile, so nothing evicts them, and no record of them is sealed.
    Only the caller that began the promotions passes them (the serving loop, whose
    compute engine attends each layer of them only once it is read and checked:
    :mod:`tokenlake.generation.tier_reads`); to everyone else they stay in flight."""
    tier, tree = pool.tier, pool.tree
    own = [p for b in batches for p in b.promos
           if tier is not None and tier._own(p) and not p.replica.ready]
    if not own:
        yield
        return
    keys = [p.key for p in own]
    tree.lease(keys)
    for p in own:
        p.replica.ready = True
        relocate(tree.node(p.key))
    try:
        yield
    finally:
        for p in own:
            if tier._own(p):
                p.replica.ready = False
                relocate(tree.node(p.key))
        tree.unlease(keys, missing_ok=True)


def promote(pool, data_plane: TierDataPlane | None,
            prompts: Iterable[tuple[Sequence[int], str | None]]) -> int:
    """:func:`begin`, the reads, :func:`end`, in one go; returns how many came back."""
    batch = begin(pool, prompts)
    if batch is None:
        return 0
    outcome = None
    try:
        outcome = data_plane.tier_read(batch.promos) if data_plane is not None else (set(), {})
    finally:
        n = end(pool, batch, outcome)
    return n
