"""The driver's side of the tiers (on disk or in host memory): the control plane's tier work
(:mod:`tokenlake.core.tier`) sent to each instance's transfer engine (``TIER_OPS``,
``TIER_READ``, and ``TIER_LIST`` at start-up: :mod:`tokenlake.dataplane.messages.tier`).

Importing this module loads no torch (the wire messages are imported where sent).
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

#: Bytes of segments one ``TIER_READ`` reads at most: a fraction of a second from a disk,
#: so that a slow one does not outlast the driver's timeout (the engine would go on
#: writing into slots the control plane took back).
READ_BYTES = 128 << 20


def tier_spec(config, role: str, inst: int) -> dict[str, Any]:
    """An engine's tier fields of its ``EngineSpec`` under ``config`` (a
    ``ClusterConfig``): a transfer engine's directory and size, or the size of its
    host-memory tier; nothing without a tier."""
    if role != "transfer" or not config.tier_bytes:
        return {}
    if config.tier_path is None:
        return {"tier_bytes": config.tier_bytes}
    # The control plane counts whole segments; the files have a header each besides
    # (key, layout, digest, the segment's place in the tree: its token ids included).
    files = config.tier_bytes // config.segment_bytes + 1
    header = 4096 + 8 * config.segment_tokens
    return {"tier_path": os.path.join(config.tier_path, f"instance-{inst}"),
            "tier_bytes": config.tier_bytes + files * header}


class TierDriver:
    """:class:`~tokenlake.core.tier.TierDataPlane` of a launcher: requests to its
    transfer engines, one per instance and call."""

    def __init__(self, cluster: Any) -> None:  # a ClusterBase (which imports this lazily)
        self.cluster = cluster

    def tier_ops(self, ops) -> tuple[list[bytes], list[bytes]]:
        """Runs the disk tiers' queued work (``{instance: TierOps}`` of
        :mod:`tokenlake.core.tier`) on each instance's transfer engine; returns the
        write-throughs staged and refused (an engine that fails refuses them all)."""
        from tokenlake.dataplane.messages import TierDone, TierEntry, TierOps  # imports torch

        staged: list[bytes] = []
        refused: list[bytes] = []
        for inst, op in ops.items():
            writes = tuple((w.slot, TierEntry(w.key, w.parent, w.index, w.tokens)) for w in op.writes)
            msg = TierOps(tuple(op.drops), writes)
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
        from tokenlake.dataplane.messages import TierDone, TierRead  # imports torch

        failed: set[bytes] = set()
        by_inst: dict[int, list] = {}
        for p in promotions:
            by_inst.setdefault(p.instance, []).append((p.key, p.slot, p.target))
        per = max(1, READ_BYTES // self.cluster.config.segment_bytes)
        for inst, items in by_inst.items():
            for at in range(0, len(items), per):  # each request well within the timeout
                part = items[at : at + per]
                try:
                    failed.update(self.cluster._request(("transfer", inst), TierRead(tuple(part)),
                                                        TierDone).failed)
                except Exception as exc:  # noqa: BLE001 - nothing read is trusted
                    log.warning("disk tier of instance %d: %s", inst, exc)
                    failed.update(item[0] for item in part)
        return failed

    def adopt(self, instances) -> int:
        """Asks each of ``instances``' transfer engines what its tier holds and gives it
        to the control plane (:meth:`~tokenlake.core.control.ControlPlane.adopt_tier`):
        what a pool started on a tier directory written before finds there. Returns the
        segments adopted."""
        from tokenlake.dataplane.messages import TierList, TierListing  # imports torch

        listings = {}
        for inst in instances:  # all of them first: a document's segments lie in several
            listing = self.cluster._request(("transfer", inst), TierList(), TierListing)
            listings[inst] = [(e.key, e.parent, e.index, e.tokens) for e in listing.entries]
        return self.cluster.control.adopt_tier(listings)
