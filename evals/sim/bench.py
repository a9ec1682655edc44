"""Simulator speed benchmark: ``tokenlake bench sim [--trace FILE] [--repeat 3]``.

Replays a Mooncake-format trace repeated ``--repeat`` times (each copy shifted to start
after the previous one; 3 x the shipped 3,993-request trace = 11,979 requests) on
``--instances`` instances and prints one JSON object: the run's metrics plus
``sim_wall_s`` (wall time of the simulation itself, loading excluded),
``events_per_s`` and ``iterations_per_s``. Target: under 60 s for the ``tokenlake``
system on one core of the development machine.
"""

from __future__ import annotations

import time
from pathlib import Path

from evals.sim.config import SimConfig
from evals.sim.systems import simulate
from evals.sim.trace import arrange, load_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def bench(trace: str | Path = DEFAULT_TRACE, system: str = "tokenlake", times: int = 3,
          instances: int = 8, speedup: float | None = None, rate: float | None = None,
          limit: int | None = None, seed: int = 0) -> dict:
    """Simulates ``times`` back-to-back copies of ``trace`` on ``system``; the run's metrics
    (``SimResult.to_dict``) plus the setup, ``load_s`` (trace loading, seconds) and
    whether ``sim_wall_s`` met the 60 s target. Arguments as in :func:`arrange`."""
    t0 = time.perf_counter()
    reqs = arrange(load_trace(trace, limit), rate, speedup, times, seed)
    load_s = time.perf_counter() - t0
    res = simulate(reqs, system, SimConfig(instances=instances, seed=seed))
    out = res.to_dict()
    out.update(trace=str(Path(trace).name), repeat=times, load_s=load_s,
               speedup=speedup, rate=rate, target_s=60.0, met=res.sim_wall_s < 60.0)
    return out
