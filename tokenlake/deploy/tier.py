"""The driver's side of the disk tiers: the control plane's tier work
(:mod:`tokenlake.core.tier`) sent to each instance's transfer engine (``TIER_OPS``,
``TIER_READ``: :mod:`tokenlake.dataplane.messages.tier`).

Importing this module loads no torch (the wire messages are imported where sent).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class TierDriver:
    """:class:`~tokenlake.core.tier.TierDataPlane` of a launcher: requests to its
    transfer engines, one per instance and call."""

    def __init__(self, cluster: Any) -> None:  # a ClusterBase (which imports this lazily)
        self.cluster = cluster

    def tier_ops(self, ops) -> tuple[list[bytes], list[bytes]]:
        """Runs the disk tiers' queued work (``{instance: TierOps}`` of
        :mod:`tokenlake.core.tier`) on each instance's transfer engine; returns the
        write-throughs staged and refused (an engine that fails refuses them all)."""
        from tokenlake.dataplane.messages import TierDone, TierOps  # imports torch (see above)

        staged: list[bytes] = []
        refused: list[bytes] = []
        for inst, op in ops.items():
            msg = TierOps(tuple(op.drops), tuple((w.key, w.slot) for w in op.writes))
            try:
                done = self.cluster._request(("transfer", inst), msg, TierDone)
            except Exception as exc:  # noqa: BLE001 - a dead engine writes nothing
                log.warning("disk tier of instance %d: %s", inst, exc)
                refused += [w.key for w in op.writes]
                continue
            staged += done.done
            refused += done.failed
        return staged, refused

    def tier_read(self, promotions) -> set[bytes]:
        """Reads each promotion's tier file into its slot (one ``TIER_READ`` per
        instance); returns the keys that failed (an engine that fails fails them all)."""
        from tokenlake.dataplane.messages import TierDone, TierRead  # imports torch (see above)

        failed: set[bytes] = set()
        by_inst: dict[int, list] = {}
        for p in promotions:
            by_inst.setdefault(p.instance, []).append((p.key, p.slot))
        for inst, items in by_inst.items():
            try:
                failed.update(self.cluster._request(("transfer", inst), TierRead(tuple(items)), TierDone).failed)
            except Exception as exc:  # noqa: BLE001 - nothing read is trusted
                log.warning("disk tier of instance %d: %s", inst, exc)
                failed.update(k for k, _ in items)
        return failed
