"""Where the simulated TokenLake runs a decision's new batches (evals/sim/pooled.py)."""

from __future__ import annotations

from typing import Any

from evals.sim.backend import Run
from scheduler.api import BatchDecision

PooledBackend = Any  # evals.sim.pooled.PooledBackend, which imports this module


def kept_or_dispatched(backend: PooledBackend, batches: tuple[BatchDecision, ...],
                       runs: list[Run], taken: set[int]) -> list[tuple[int, ...]]:
    """Instances for the new runs (``taken`` are busy): a decode batch the decision keeps
    on its instance (``BatchDecision.instance``) runs there; the others go where the
    dispatch puts them (:meth:`~evals.sim.run_timing.RunTiming.place`) among the rest."""
    out: list[tuple[int, ...] | None] = [None] * len(runs)
    taken = set(taken)
    for n, batch in enumerate(batches):
        if batch.instance is not None and batch.instance not in taken:
            out[n] = (batch.instance,)
            taken.add(batch.instance)
    rest = [n for n in range(len(runs)) if out[n] is None]
    if rest:
        free = [i for i in backend.instance_ids if i not in taken]
        for n, group in zip(rest, backend.timing.place([runs[n] for n in rest], free)):
            out[n] = group
    return out


def fixed_split(backend: PooledBackend, batches: tuple[BatchDecision, ...],
                taken: set[int]) -> list[tuple[int, ...]]:
    """Instances per batch of a fixed PD split (``taken`` are busy): a decode batch
    keeps its first request's last instance when it can; the rest take the instances
    of their role free earliest."""
    out: list[tuple[int, ...] | None] = [None] * len(batches)
    allowed = [tuple(backend.fixed.allowed_instances(batch)) for batch in batches]
    for n, batch in enumerate(batches):
        w = backend.tracker[batch.request_ids[0]].worker
        if batch.phase == "decode" and w is not None and w not in taken and w in allowed[n]:
            out[n] = (w,)
            taken.add(w)
    for n in sorted(range(len(batches)), key=lambda n: -batches[n].dop):
        if out[n] is None:
            free = sorted((i for i in allowed[n] if i not in taken),
                          key=lambda i: (backend.free_at[i], i))[: batches[n].dop]
            out[n] = tuple(free)
            taken.update(free)
    return out
