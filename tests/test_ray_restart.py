"""`tokenlake serve --ray` outlives its driver (docs/deploy-ray.md "When the driver
dies"), on one node: the pool's actors are named and detached on a Ray that outlives
the driver (here the Ray modules' shared one, tests/ray_util.py, which this test process
started); the driver is killed with `kill -9`; a new one on the same control port adopts
them and the next question about the cached document hits what it hit before and
answers the same text. Not adopted, the actors end after their grace with every buffer,
the placement group and the state file.

Other test runs on this machine make and unlink buffers of their own meanwhile: a pool's
buffers are those its ``ready`` events name and those made by its processes."""

from __future__ import annotations

import contextlib
import signal
import time

import pytest

ray = pytest.importorskip("ray")

import ray_util  # noqa: E402
from test_restart_serve import Serve  # noqa: E402

from tokenlake.dataplane import pool_state  # noqa: E402
from tokenlake.dataplane.shm_files import list_buffers, unlink_buffer  # noqa: E402
from tokenlake.deploy.ray.orphans import NAMESPACE, actor_name, group_name  # noqa: E402
from tokenlake.tools.bench.restart import free_ports  # noqa: E402

pytestmark = pytest.mark.ray

shared_ray = ray_util.shared_ray_fixture()


@pytest.fixture(scope="module")
def ray_address(shared_ray):
    """The shared Ray, which outlives the drivers the tests run (they join it); this
    process is a driver of it too, in the pools' namespace."""
    with ray_util.driver(shared_ray, namespace=NAMESPACE):
        yield shared_ray.address


class _Serve(Serve):
    """A driver that keeps its ``ready`` event."""

    event: dict | None = None

    def ready(self) -> dict:
        self.event = super().ready()
        return self.event


@pytest.fixture
def drivers(tmp_path, ray_address):
    """Starts drivers of one pool; afterwards kills them and, should a test have failed,
    what their pool left on the shared Ray (the next module's Ray, which a failed
    test here must not spoil): its actors, its placement group and its buffers."""
    made: list[_Serve] = []
    ports = free_ports(2)  # below the ephemeral range: no engine of the serve takes one first

    def start(*flags: str) -> _Serve:
        made.append(_Serve(tmp_path, *ports, "--ray", ray_address, "--cpus-per-instance", "0.5", *flags))
        return made[-1]

    try:
        yield start, ports[0]
    finally:
        for serve in made:
            serve.close()
        for role, i in _our_actors(ports[0]):
            ray.kill(ray.get_actor(actor_name(f"serve-{ports[0]}", role, i), namespace=NAMESPACE))
        if f"tokenlake-serve-{ports[0]}" in _groups():
            from ray.util.placement_group import get_placement_group, remove_placement_group

            remove_placement_group(get_placement_group(group_name(f"serve-{ports[0]}")))
        for name in _ours(made):
            unlink_buffer(name)


def _ours(made: list[_Serve]) -> set[str]:
    """The buffers of the pool of ``made`` still there: those their ``ready`` events
    name, and any other made by one of their processes (its pid is in the name,
    ``tokenlake-<pid>-...``)."""
    events = [serve.event for serve in made if serve.event is not None]
    names = {b for e in events for inst in e["instances"] for b in inst["buffers"]}
    pids = {serve.proc.pid for serve in made} | {
        pid for e in events for inst in e["instances"] for pid in inst["pids"].values()}
    return {b for b in list_buffers() if b in names or _creator_pid(b) in pids}


def _creator_pid(name: str) -> int | None:
    with contextlib.suppress(IndexError, ValueError):
        return int(name.split("-")[1])
    return None


def _our_actors(port: int) -> list[tuple[str, int]]:
    found = []
    for i in range(2):
        for role in ("host", "query", "transfer"):
            try:
                ray.get_actor(actor_name(f"serve-{port}", role, i), namespace=NAMESPACE)
                found.append((role, i))
            except ValueError:
                pass
    return found


def _groups() -> set[str]:
    from ray.util import placement_group_table

    return {v["name"] for v in placement_group_table().values() if v["state"] != "REMOVED"}


def test_a_new_driver_adopts_the_pool_a_killed_one_left_on_ray(drivers, tmp_path):
    start, port = drivers
    first = start()
    first.ready()
    assert _ours([first]), "the pool's buffers are not where this test looks"
    first.ask("Who is it about?")
    text, hit = first.ask("What happened?")
    assert hit > 200
    first.kill()
    assert len(_our_actors(port)) == 6, "the named actors died with the driver"

    second = start()
    ready = second.ready()
    assert ready["restored"] > 0
    again, hit_again = second.ask("What happened?")
    assert hit_again >= 0.9 * hit and again == text
    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(60) == 0
    assert _our_actors(port) == [] and f"tokenlake-serve-{port}" not in _groups()
    assert not _ours([first, second]), "shared memory left behind"
    assert not list(tmp_path.glob("*.json")), "a state or credentials file outlived the pool"


def test_actors_not_adopted_end_after_their_grace(drivers, tmp_path):
    start, port = drivers
    first = start("--orphan-grace-s", "3")
    first.ready()
    assert pool_state.read(tmp_path / f"pool-{port}.json")["cluster_id"] == f"serve-{port}"
    assert _ours([first]), "the pool's buffers are not where this test looks"
    first.kill()
    killed = time.monotonic()
    deadline = killed + 5 + 3 + 20  # heartbeat timeout, grace, margin for a loaded machine
    # everything the last actor removes: the placement group may go before its files
    while (_our_actors(port) or _ours([first]) or f"tokenlake-serve-{port}" in _groups()
           or list(tmp_path.glob("*.json"))):
        assert time.monotonic() < deadline, (_our_actors(port), _ours([first]), _groups(),
                                             list(tmp_path.glob("*.json")))
        time.sleep(0.2)
    assert time.monotonic() - killed > 5, "the actors did not wait"
