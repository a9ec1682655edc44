"""One Ray cluster for the Ray test modules (test_ray, test_ray_nodes, test_ray_restart
and test_ray_serve), which pytest runs one after another.

Starting a Ray head takes seconds (four times as long on a loaded 2-core machine), and
these modules used to start six. They now share one head node, started by this process
with Ray's own ``cluster_utils.Cluster``: 2 CPUs, no GPU, no dashboard. Each module
connects a driver of its own to it (``ray.init(address=...)``) and disconnects it
(``ray.shutdown()`` leaves a cluster the driver did not start running), as every driver
of a running Ray does; ``tokenlake serve --ray ADDRESS`` joins it the same way.
test_ray_nodes adds a worker node for its test and removes it again.

A test that uses the cluster does so through a fixture named ``shared_ray``
(:func:`shared_ray_fixture`). When that fixture ends, the cluster must be as it was
found: no actor alive (detached ones included), no placement group left, no worker node
(else the fixture fails, and the cluster is stopped so that the next module gets a
fresh one). The cluster is then stopped unless the test pytest runs next uses it too:
no Ray runs through the modules after these (nor, in test_ray_serve, beside the test
that starts a Ray of its own). A run that ends early (``-x``, Ctrl-C) stops it at exit.

Also here: the SmolLM2 prompts the compute tests share and their reference outputs,
computed once per prompt (the reference engine is slow on 2 cores)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster

#: what the head node offers: the tests' resource arithmetic (and error messages) count on it
HEAD_CPUS = 2
#: the fixture name by which the cluster is held (and by which the next test is seen to use it)
FIXTURE = "shared_ray"

_cluster: Cluster | None = None


def shared_ray_fixture(scope: str = "module"):
    """The ``shared_ray`` fixture of a module (``shared_ray = shared_ray_fixture()``):
    the shared :class:`Cluster`, held for ``scope`` (:func:`held`); no driver connected."""

    @pytest.fixture(scope=scope, name=FIXTURE)
    def shared_ray(request) -> Iterator[Cluster]:
        with held(request) as cluster:
            yield cluster

    return shared_ray


@contextlib.contextmanager
def held(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The shared cluster (started on first use) for the scope of ``request``'s fixture;
    checked clean afterwards, and stopped unless the next test holds it too."""
    global _cluster
    if _cluster is None:
        # shutdown_at_exit (the default): the head's processes end with this process too
        _cluster = Cluster(initialize_head=True,
                           head_node_args={"num_cpus": HEAD_CPUS, "num_gpus": 0, "include_dashboard": False})
    keep = False
    try:
        yield _cluster
        assert not ray.is_initialized(), "a driver is still connected to the shared Ray"
        _check_clean(_cluster)
        keep = _next_test_uses_it(request)
    finally:
        if not keep:
            stop()


def stop() -> None:
    """Stops the shared cluster (every node's processes; nothing if none runs)."""
    global _cluster
    cluster, _cluster = _cluster, None
    if cluster is not None:
        if ray.is_initialized():  # a driver a failed fixture left connected
            ray.shutdown()
        cluster.shutdown()


@contextlib.contextmanager
def driver(cluster: Cluster, namespace: str | None = None) -> Iterator[None]:
    """This process as a driver of ``cluster`` (in ``namespace``) for the block; its
    non-detached actors and placement groups end when it disconnects."""
    ray.init(address=cluster.address, namespace=namespace, log_to_driver=False, logging_level="ERROR")
    try:
        yield
    finally:
        ray.shutdown()


def _check_clean(cluster: Cluster, timeout_s: float = 30.0) -> None:
    """Fails (naming them) while actors are alive or placement groups are left on
    ``cluster``, or worker nodes are in it; a disconnected driver's actors take a moment
    to be marked dead."""
    state = cluster.global_state
    deadline = time.monotonic() + timeout_s
    while True:
        actors = sorted(a.get("Name") or a["ActorID"] for a in state.actor_table(None).values()
                        if a["State"] != "DEAD")
        groups = sorted(g["name"] or g["placement_group_id"] for g in state.placement_group_table().values()
                        if g["state"] != "REMOVED")
        if not (actors or groups) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not (actors or groups or cluster.worker_nodes), \
        f"left on the shared Ray: actors {actors}, placement groups {groups}, worker nodes {cluster.worker_nodes}"


def _next_test_uses_it(request: pytest.FixtureRequest) -> bool:
    """Whether the test pytest runs after the last one of ``request``'s scope holds the
    shared cluster too (not when the run is stopping)."""
    session = request.session
    if session.shouldstop or session.shouldfail:
        return False
    items, node = session.items, request.node
    last = max((k for k, item in enumerate(items) if node in item.listchain()), default=len(items))
    return last + 1 < len(items) and FIXTURE in items[last + 1].fixturenames


# ------------------------------------------------------------------ SmolLM2 compute tests

NEW = 4  # generated tokens per request (the reference engine is slow on 2 cores)


def short_prompts(tok) -> list[tuple[int, ...]]:
    """Three questions about one sentence: ~45 tokens each, the first ~38 shared."""
    system = {"role": "system", "content": "Answer in a few words."}
    doc = "The river Lumen runs 212 km from the Grey Hills to Kestrel Bay."
    qs = ["How long is it?", "Where does it end?", "Where does it start?"]
    return [tuple(tok.apply_chat_template([system, {"role": "user", "content": f"{doc} {q}"}])) for q in qs]


_reference: dict[tuple, tuple] = {}


def reference(ref, prompt, new: int, stop_ids: tuple[int, ...]):
    """``ref.generate(prompt, new, stop_ids)``, computed once per weights, KV dtype and
    arguments in this process (greedy generation is deterministic; every Ray module's
    reference engine is conftest's ``smollm2``, over the one cached ``load_weights()``).
    The entry keeps the weights alive, so their ``id`` is not reused while it exists."""
    key = (id(ref.weights), ref.kv_dtype, tuple(prompt), new, tuple(stop_ids))
    if key not in _reference:
        _reference[key] = (ref.weights, ref.generate(list(prompt), new, stop_ids=stop_ids))
    return _reference[key][1]


# ------------------------------------------------------- the command at a terminal


def serve_at_a_terminal(argv: list[str], operator) -> list[BaseException]:
    """``tokenlake <argv>`` (a ``serve``) run in this thread as a person at a terminal
    runs it: ``operator()`` (reading the events, asking, killing) in another thread, then
    Ctrl-C (SIGINT); asserts the command exits 0 and returns what ``operator`` raised."""
    from tokenlake.tools import cli

    failure: list[BaseException] = []

    def at_the_terminal() -> None:
        try:
            operator()
        except BaseException as exc:  # reported to the caller
            failure.append(exc)
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C

    term = signal.getsignal(signal.SIGTERM)
    watcher = threading.Thread(target=at_the_terminal, daemon=True)
    watcher.start()
    try:
        assert cli.main(argv) == 0
    finally:
        signal.signal(signal.SIGTERM, term)
        watcher.join(timeout=10)
    return failure
