"""Simulator speed benchmark: ``python -m evals.sim.bench [--trace FILE] [--repeat 3]``.

Replays a Mooncake-format trace repeated ``--repeat`` times (each copy shifted to start
after the previous one; 3 x the shipped 3,993-request trace = 11,979 requests) on
``--instances`` instances and prints one JSON object: the run's metrics plus
``sim_wall_s`` (wall time of the simulation itself, loading excluded),
``events_per_s`` and ``iterations_per_s``. Target: under 60 s for the ``tokenlake``
system on one core of the development machine.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

from evals.sim.config import SimConfig
from evals.sim.systems import SYSTEMS, simulate
from evals.sim.trace import arrange, load_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def bench(trace: str | Path = DEFAULT_TRACE, system: str = "tokenlake", times: int = 3,
          instances: int = 8, speedup: float | None = None, rate: float | None = None,
          limit: int | None = None, seed: int = 0) -> dict:
    t0 = time.perf_counter()
    reqs = arrange(load_trace(trace, limit), rate, speedup, times, seed)
    load_s = time.perf_counter() - t0
    res = simulate(reqs, system, SimConfig(instances=instances, seed=seed))
    out = res.to_dict()
    out.update(trace=str(Path(trace).name), repeat=times, load_s=load_s,
               speedup=speedup, rate=rate, target_s=60.0, met=res.sim_wall_s < 60.0)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evals.sim.bench", description=__doc__.split("\n")[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--system", default="tokenlake", choices=SYSTEMS)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--speedup", type=float, default=None)
    p.add_argument("--rate", type=float, default=None)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(json.dumps(bench(a.trace, a.system, a.repeat, a.instances, a.speedup, a.rate,
                           a.limit, a.seed), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
