"""The driver side of the compute actors: :class:`RayComputeEngine` runs an iteration's
batches on the compute actors of their home instances; :class:`ComputeActors` creates,
opens and stops those actors for a :class:`~tokenlake.deploy.ray.RayCluster`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tokenlake.core.errors import EngineUnavailable, PlanError, TokenLakeError
from tokenlake.core.plans import Batch, Plans
from tokenlake.deploy.ray.actors import ComputeActorRemote
from tokenlake.deploy.ray.options import COMPUTE_ROLE, RayOptions
from tokenlake.deploy.ray.relay import ActorTable, actor_error

if TYPE_CHECKING:
    from tokenlake.engines.compute import IterationOutput

log = logging.getLogger(__name__)


class ComputeActorSource(Protocol):
    """What :class:`RayComputeEngine` needs of a cluster (``RayCluster`` is one)."""

    def compute_actor(self, instance: int) -> Any:
        """The handle of ``instance``'s compute actor (``EngineUnavailable`` if none)."""


def _parts_by_home(plans: Plans, n_batches: int) -> dict[int, list[int]]:
    """``{home instance: [index into plans.query_plans, ...]}``; plans that do not cover
    exactly batches ``0..n_batches-1`` are a ``PlanError``."""
    covered = {qp.batch for qp in plans.query_plans}
    if covered != set(range(n_batches)):
        raise PlanError(f"the plans cover batches {sorted(covered)}, not the {n_batches} given")
    by_home: dict[int, list[int]] = {}
    for k, qp in enumerate(plans.query_plans):
        by_home.setdefault(qp.home, []).append(k)
    return by_home


def _sub_plans(plans: Plans, parts: list[int]) -> Plans:
    """The sub-batch plans ``parts`` (indices) only, with the iteration's ``groups``:
    what one compute actor sees of the iteration."""
    return Plans(plans.iteration, tuple(plans.query_plans[k] for k in parts),
                 tuple(plans.transfer_plans[k] for k in parts), plans.groups)


def _later_homes(plans: Plans, parts: list[int]) -> set[int]:
    """The homes of the sub-batches after ``parts`` in their batches (DoP > 1): the
    actors that receive K/V rows from these parts."""
    out: set[int] = set()
    for k in parts:
        qp = plans.query_plans[k]
        out.update(plans.groups[qp.batch][qp.part + 1 :])
    return out


class RayComputeEngine:
    """Driver side of the compute actors, with the interface of
    :class:`~tokenlake.engines.compute.ComputeEngine` (``run(plans, batches) ->
    IterationOutput``), so :class:`~tokenlake.generation.Server` can use either.

    Each sub-batch goes to the compute actor of its home instance (several with the
    same home run there one after the other); the actors of one iteration run in
    parallel, and :meth:`run` returns when all of them are done (every put stored).
    The sub-batches of a DoP > 1 batch compute at once on their actors, which pass a
    crossing request's K/V rows to the later ones layer by layer
    (:mod:`tokenlake.deploy.ray.exchange`). A dead or missing compute actor is an
    ``EngineUnavailable``; so is an iteration not finished within ``timeout_s``.

    ``batches_run[i]`` counts the sub-batches computed by instance i's actor.
    ``parallel = True`` tells the ``GenerationLoop`` that batches on different instances
    compute at the same time (one batch per instance and iteration).
    """

    parallel = True

    def __init__(self, cluster: ComputeActorSource, timeout_s: float | None = 300.0) -> None:
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.batches_run: dict[int, int] = {}

    def run(self, plans: Plans, batches: list[Batch]) -> IterationOutput:
        from tokenlake.engines.compute import IterationOutput  # the model layer: torch

        by_home = _parts_by_home(plans, len(batches))
        if not batches:
            return IterationOutput({}, {})
        actors = {home: self.cluster.compute_actor(home) for home in by_home}  # before sending
        refs = {}
        for home, parts in by_home.items():
            mine = {plans.query_plans[k].batch for k in parts}
            peers = {h: actors[h] for h in _later_homes(plans, parts) if h != home}
            refs[home] = actors[home].run.remote(_sub_plans(plans, parts), {b: batches[b] for b in mine}, peers)
        return self._collect(refs, by_home)

    def _collect(self, refs: dict[int, Any], by_home: dict[int, list[int]]) -> IterationOutput:
        """Waits for every actor, also after a failure (the caller aborts the plans
        next); merges their outputs, or raises the first failure."""
        import torch  # the model layer's tensors

        from tokenlake.engines.compute import IterationOutput  # the model layer: torch

        ready = set(ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.timeout_s)[0])
        logits, prefix, error = {}, {}, None
        for home, ref in refs.items():
            try:
                if ref not in ready:
                    raise EngineUnavailable(f"the compute actor of instance {home} did not finish "
                                            f"the iteration within {self.timeout_s:.0f} s")
                ids, rows, spans = ray.get(ref)
            except RayActorError:
                error = error or EngineUnavailable(f"the compute actor of instance {home} is not running")
                continue
            except (RayError, TokenLakeError) as exc:
                error = error or actor_error(exc)
                continue
            if ids:
                table = torch.tensor(rows)  # a copy: Ray's array is read-only shared memory
                logits.update((rid, table[k]) for k, rid in enumerate(ids))
            prefix.update(spans)
            self.batches_run[home] = self.batches_run.get(home, 0) + len(by_home[home])
        if error is not None:
            raise error
        return IterationOutput(logits, prefix)


class ComputeActors:
    """The compute actors of a cluster's instances, as the driver starts and stops them.

    Their handles and processes live in the cluster's :class:`ActorTable` under the role
    ``"compute"``. Each actor asks for ``options.resources("compute")`` and runs torch
    with ``threads`` threads (default: its whole CPUs, at least 1); ``loader`` is the
    weights loader it calls once (None: the default weights).
    """

    def __init__(self, table: ActorTable, options: RayOptions, loader: Callable[[], Any] | None,
                 threads: int | None, start_timeout_s: float) -> None:
        self.table, self.options, self.loader = table, options, loader
        self.resources = options.resources(COMPUTE_ROLE)
        self.threads = int(threads) if threads is not None else max(1, int(self.resources["num_cpus"]))
        self.start_timeout_s = start_timeout_s

    def create(self, bundles: dict[int, PlacementGroupSchedulingStrategy]) -> None:
        """Creates the actors of ``{instance: its bundle}`` (each loads torch and the
        weights now, asynchronously)."""
        for i, bundle in bundles.items():
            log.info("starting instance %d's compute actor (it loads the weights)", i)
            self.table.actors[(COMPUTE_ROLE, i)] = ComputeActorRemote.options(
                scheduling_strategy=bundle, **self.resources
            ).remote(i, self.loader, self.threads)

    def open(self, infos: dict[int, dict[str, Any]]) -> None:
        """Hands each created actor its instance's ``client_info``; waits until all are
        ready (at most ``start_timeout_s``). Actor failures are ``EngineUnavailable``,
        the TokenLake errors they raised (a ``ConfigError``: weights that do not fit)
        are raised as such."""
        refs = {i: self.table.actors[(COMPUTE_ROLE, i)].open.remote(info) for i, info in infos.items()}
        try:
            procs = ray.get(list(refs.values()), timeout=self.start_timeout_s)
        except GetTimeoutError:
            raise EngineUnavailable(
                f"compute start-up: no answer within {self.start_timeout_s:.0f} s (does the bundle have "
                f"{self.resources} left for the compute actor? see `ray status`)") from None
        except RayActorError as exc:
            raise EngineUnavailable(f"compute start-up failed: {exc}") from exc
        except RayError as exc:
            raise actor_error(exc) from exc
        for i, proc in zip(refs, procs):
            self.table.procs[(COMPUTE_ROLE, i)] = proc
            log.info("instance %d's compute actor ready (pid %d)", i, proc.pid)

    def stop(self, instances: list[int], node: str) -> None:
        """Closes the clients of the instances' actors, kills the actors and waits until
        those on ``node`` (the driver's) are gone."""
        keys = [(COMPUTE_ROLE, i) for i in instances if (COMPUTE_ROLE, i) in self.table.actors]
        self.table.stop(keys)
        self.table.kill(keys, node)
        self.table.forget(keys)
