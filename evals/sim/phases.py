"""The instances the scheduler gives each phase over simulated time (docs/simulator.md).

Each policy decision of a pooled run says how many instances it gives prefill and decode
(:attr:`scheduler.api.Decision.instances_per_phase`); :class:`PhaseLog` keeps the points
where that split changed, and sums it up per run: the time-weighted mean instances per
phase (the rest idle or waiting for memory), how often the split changed, and, with
``--series``, the whole timeline.
"""

from __future__ import annotations


class PhaseLog:
    """``(time, prefill instances, decode instances)`` at every change of the split."""

    def __init__(self) -> None:
        self.points: list[tuple[float, int, int]] = []

    def record(self, t: float, split: dict[str, int]) -> None:
        point = (t, split.get("prefill", 0), split.get("decode", 0))
        if self.points and self.points[-1][1:] == point[1:]:
            return
        if self.points and self.points[-1][0] == t:  # decided again at the same time
            self.points[-1] = point
            if len(self.points) > 1 and self.points[-2][1:] == point[1:]:
                self.points.pop()
            return
        self.points.append(point)

    def summary(self, end_s: float, instances: int) -> dict:
        """Time-weighted mean instances per phase from the first decision to ``end_s``,
        the idle rest, and the changes of the split (count and per simulated second)."""
        if not self.points:
            return {"prefill": 0.0, "decode": 0.0, "idle": float(instances), "changes": 0,
                    "changes_per_s": 0.0}
        t0 = self.points[0][0]
        span = max(end_s - t0, 0.0)
        pre = dec = 0.0
        for (t, p, d), nxt in zip(self.points, self.points[1:] + [(max(end_s, t0), 0, 0)]):
            dt = max(nxt[0] - t, 0.0)
            pre += p * dt
            dec += d * dt
        mean_p, mean_d = (pre / span, dec / span) if span > 0 else self.points[-1][1:]
        changes = len(self.points) - 1
        return {"prefill": mean_p, "decode": mean_d, "idle": instances - mean_p - mean_d,
                "changes": changes, "changes_per_s": changes / span if span > 0 else 0.0}

    def series(self) -> list[list[float]]:
        """The timeline as JSON-ready ``[time, prefill, decode]`` rows."""
        return [list(p) for p in self.points]
