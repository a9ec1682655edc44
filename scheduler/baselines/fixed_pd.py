"""TokenLake with a fixed P:D split (the paper's ablation): any policy, roles pinned.

:class:`FixedPD` wraps a :class:`scheduler.api.Policy` (e.g. TokenLake's DP scheduler).
Each iteration it asks the inner policy twice: once for the prefill requests with only
the free *prefill* instances free, once for the decode requests with only the free
*decode* instances free, and merges the two decisions. So prefill batches never need
more than the prefill instances and decode batches more than the decode ones;
:meth:`FixedPD.allowed_instances` tells a dispatcher which instances a batch may use.
``FixedPD.split(instances, "1P3D", inner)`` gives the paper's two configurations.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from scheduler.api import BatchDecision, Decision, Policy, Snapshot


class FixedPD:
    def __init__(self, inner: Policy, prefill_instances: Sequence[int],
                 decode_instances: Sequence[int]) -> None:
        if not prefill_instances or not decode_instances:
            raise ValueError("need at least one prefill and one decode instance")
        if set(prefill_instances) & set(decode_instances):
            raise ValueError("an instance cannot be both prefill and decode")
        self.inner = inner
        self.prefill_instances = tuple(prefill_instances)
        self.decode_instances = tuple(decode_instances)
        self.name = f"{getattr(inner, 'name', 'policy')}-{len(prefill_instances)}P{len(decode_instances)}D"

    @classmethod
    def split(cls, instances: Sequence[int], config: str, inner: Policy) -> FixedPD:
        m = re.fullmatch(r"(\d+)P(\d+)D", config)
        if m is None or int(m.group(1)) + int(m.group(2)) != len(instances):
            raise ValueError(f"bad config {config!r} for {len(instances)} instances")
        x = int(m.group(1))
        return cls(inner, instances[:x], instances[x:])

    def _phase_view(self, snap: Snapshot, phase: str) -> Snapshot:
        mine = set(self.prefill_instances if phase == "prefill" else self.decode_instances)
        return dataclasses.replace(
            snap,
            waiting=tuple(r for r in snap.waiting if r.phase == phase),
            running=tuple(r for r in snap.running if r.phase == phase),
            instances=tuple(dataclasses.replace(i, busy=i.busy or i.instance not in mine)
                            for i in snap.instances),
        )

    def schedule(self, snap: Snapshot) -> Decision:
        batches: list[BatchDecision] = []
        notes = []
        for phase in ("prefill", "decode"):
            view = self._phase_view(snap, phase)
            if not view.requests or view.free_instances == 0:
                continue
            d = self.inner.schedule(view)
            d.check(view)
            if any(b.phase != phase for b in d.batches):
                raise ValueError(f"inner policy scheduled another phase in the {phase} view")
            batches.extend(d.batches)
            if d.note:
                notes.append(f"{phase}: {d.note}")
        return Decision(tuple(batches), note="; ".join(notes))

    def allowed_instances(self, batch: BatchDecision) -> tuple[int, ...]:
        return self.prefill_instances if batch.phase == "prefill" else self.decode_instances
