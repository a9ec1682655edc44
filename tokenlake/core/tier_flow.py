"""The control plane's tier calls (:meth:`~tokenlake.core.control.ControlPlane.flush_tier`
and :meth:`~tokenlake.core.control.ControlPlane.promote`): the bookkeeping of
:mod:`tokenlake.core.tier` handed to a :class:`~tokenlake.core.tier.TierDataPlane` and
its answers recorded. Without a data plane (the simulator, the core's tests) every
move counts as done at once."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenlake.core.tier import Promotion, TierDataPlane


def flush(pool, data_plane: TierDataPlane | None) -> None:
    """Hands the tiers' queued work (copies to drop, new segments to write through) to
    ``data_plane`` and records what it staged; frees what fenced engines held back."""
    tier = pool.tier
    if tier is None:
        return
    if data_plane is None:
        tier.settle()  # nothing moves data: staged at once
        return
    tier.staged(*data_plane.tier_ops(tier.take_ops()))  # also with none: it fences the silent
    for instance in data_plane.fenced():
        tier.release(instance)


def promote(pool, data_plane: TierDataPlane | None,
            prompts: Iterable[tuple[Sequence[int], str | None]]) -> list[Promotion]:
    """Brings the segments of each ``(token ids, cache salt)`` prompt's prefix that are
    held only in a tier back into slots, parent first; returns the promotions tried
    (:func:`flush` still to run: the failed ones' copies go). A segment whose copy is
    missing or corrupt goes, with what follows it; one whose read got no answer keeps
    its slot taken until its engine is fenced (:meth:`~tokenlake.core.tier.TierManager.hold_back`)."""
    tier = pool.tier
    promos: list[Promotion] = []
    leased: list[bytes] = []  # each prompt's hit in the slabs, kept from the others' promotions
    failed: set[bytes] | None = None
    unanswered: set[bytes] = set()
    try:
        for tokens, salt in prompts:
            m = pool.match(tokens, max_tokens=max(len(tokens) - 1, 0), salt=salt)
            if m.tier_keys:
                pool.lease(m.keys)
                leased += m.keys
                promos += tier.promote(m.tier_keys)
        if promos and data_plane is not None:
            failed, unanswered = data_plane.tier_read(promos)
        else:
            failed = set()  # nothing moves data: read at once
    finally:
        if failed is None:  # an exception before anything was read: back in the tier only
            for p in reversed(promos):
                tier.unpromote(p)
        else:
            for p in promos:  # first: a failed parent's subtree must leave these slots taken
                if p.key in unanswered:
                    tier.hold_back(p)
            for p in promos:  # parent first: a failed parent takes its children along
                (tier.promotion_failed if p.key in failed else tier.promoted)(p)
        pool.unlease(leased, missing_ok=True)
    return promos
