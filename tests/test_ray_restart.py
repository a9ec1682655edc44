"""`tokenlake serve --ray` outlives its driver (docs/deploy-ray.md "When the driver
dies"), on one node: the pool's actors are named and detached on a Ray that outlives
the driver (here this test process's own Ray); the driver is killed with `kill -9`; a
new one on the same control port adopts them and the next question about the cached
document hits what it hit before and answers the same text. Not adopted, the actors end
after their grace with every buffer, the placement group and the state file."""

from __future__ import annotations

import signal
import time

import pytest

ray = pytest.importorskip("ray")

from test_restart_serve import Serve, _free_port  # noqa: E402

from tokenlake.dataplane import pool_state  # noqa: E402
from tokenlake.dataplane.shm_files import list_buffers  # noqa: E402
from tokenlake.deploy.ray.orphans import NAMESPACE, actor_name  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture
def ray_address():
    """A Ray of this test's own that outlives the drivers it runs (they join it)."""
    ctx = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                   namespace=NAMESPACE)
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()  # detached actors included


@pytest.fixture
def drivers(tmp_path, ray_address):
    made: list[Serve] = []
    ports = (_free_port(), _free_port())

    def start(*flags: str) -> Serve:
        made.append(Serve(tmp_path, *ports, "--ray", ray_address, "--cpus-per-instance", "0.5", *flags))
        return made[-1]

    try:
        yield start, ports[0]
    finally:
        for serve in made:
            serve.close()


def _our_actors(port: int) -> list[str]:
    found = []
    for i in range(2):
        for role in ("host", "query", "transfer"):
            try:
                ray.get_actor(actor_name(f"serve-{port}", role, i), namespace=NAMESPACE)
                found.append(f"{role}-{i}")
            except ValueError:
                pass
    return found


def _groups() -> set[str]:
    from ray.util import placement_group_table

    return {v["name"] for v in placement_group_table().values() if v["state"] != "REMOVED"}


def test_a_new_driver_adopts_the_pool_a_killed_one_left_on_ray(drivers, tmp_path):
    start, port = drivers
    before = set(list_buffers())
    first = start()
    first.ready()
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
    assert not (set(list_buffers()) - before), "shared memory left behind"
    assert not list(tmp_path.glob("*.json")), "a state or credentials file outlived the pool"


def test_actors_not_adopted_end_after_their_grace(drivers, tmp_path):
    start, port = drivers
    before = set(list_buffers())
    first = start("--orphan-grace-s", "3")
    first.ready()
    assert pool_state.read(tmp_path / f"pool-{port}.json")["cluster_id"] == f"serve-{port}"
    first.kill()
    killed = time.monotonic()
    deadline = killed + 5 + 3 + 20  # heartbeat timeout, grace, margin for a loaded machine
    while _our_actors(port) or (set(list_buffers()) - before) or f"tokenlake-serve-{port}" in _groups():
        assert time.monotonic() < deadline, (_our_actors(port), set(list_buffers()) - before, _groups())
        time.sleep(0.2)
    assert time.monotonic() - killed > 5, "the actors did not wait"
    assert not list(tmp_path.glob("*.json")), "a state or credentials file outlived the pool"
