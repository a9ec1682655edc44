"""A dead engine's instance is found, taken out, its segments recomputed, and the
instance rejoins empty (issue #17, finding 6, at the cluster level)."""

from __future__ import annotations

import random
import threading
import time

import pytest
from dataplane_util import TINY
from test_dataplane import POOL_BYTES, C, run_iteration

from tokenlake.core.errors import ConfigError
from tokenlake.deploy.local import LocalCluster


def test_a_failed_instance_is_removed_recomputed_and_rejoins_empty():
    with LocalCluster(3, TINY, POOL_BYTES, segment_tokens=C, max_rows=128,
                      peer_timeout_s=2.0) as cluster:
        cp = cluster.control
        rng = random.Random(4)
        doc = [rng.randrange(3, 900) for _ in range(8 * C)]
        tokens = {"r": doc + [rng.randrange(3, 900) for _ in range(3)]}
        run_iteration(cluster, tokens, {"r": len(tokens["r"])})
        cp.finish_request("r")
        on_2 = cp.stats().pool.slots_used.get(2, 0)
        assert on_2 > 0, "the document spans instance 2"

        deaths: list[tuple[str, int]] = []
        seen = threading.Event()
        cluster.add_failure_listener(lambda role, inst: (deaths.append((role, inst)), seen.set()))
        cluster.kill("transfer", 2)
        killed = time.monotonic()
        assert seen.wait(2.0), "the watcher did not see the death within 2 s"
        assert deaths == [("transfer", 2)] and cluster.failures[("transfer", 2)] - killed < 2.0
        assert cluster.failed_instances() == [2]  # read from the process sentinels
        cluster.remove_instance(2)  # stops its query engine too: on purpose, no failure
        assert 2 not in cp.instances and not cluster.alive("query", 2)
        cp.check()

        # the same document again: what instance 2 held is computed again, and equal
        tokens["again"] = doc + [rng.randrange(3, 900) for _ in range(5)]
        hit = cp.get_prefix_tree().match(tokens["again"], max_tokens=len(doc)).hit_tokens
        assert hit < len(doc), "the segments on instance 2 left the tree"
        run_iteration(cluster, tokens, {"again": len(tokens["again"]) - hit},
                      first_prefix={"again": hit})
        cp.finish_request("again")

        with pytest.raises(ConfigError, match="remove it first"):
            cluster.restart_instance(1)
        cluster.restart_instance(2)  # it rejoins empty and takes its share again
        assert 2 in cp.instances and cluster.alive("query", 2) and cluster.alive("transfer", 2)
        assert deaths == [("transfer", 2)] and not cluster.failures  # the new engines are watched
        assert cp.stats().pool.slots_used.get(2, 0) == 0
        tokens["new"] = [rng.randrange(3, 900) for _ in range(8 * C)]
        run_iteration(cluster, tokens, {"new": 8 * C})
        assert cp.stats().pool.slots_used.get(2, 0) > 0, "instance 2 stores again"
        tokens["reuse"] = tokens["new"] + [7, 8, 9]
        run_iteration(cluster, tokens, {"reuse": 3}, first_prefix={"reuse": 8 * C})
        cp.finish_request("new")
        cp.finish_request("reuse")


def test_a_transfer_engine_killed_during_an_iteration_fails_its_puts_and_the_pool_recovers():
    """The peer transfer engine that should store part of an iteration's K/V dies: the
    put fails with EngineUnavailable within seconds, the plans are aborted (nothing of
    them is visible), and after replacing the instance the same request is stored and
    read back equal to the reference."""
    from tokenlake.core.errors import EngineUnavailable
    from tokenlake.core.plans import Batch, BatchRequest

    with LocalCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=128, timeout_s=10.0,
                      peer_timeout_s=2.0) as cluster:
        cp = cluster.control
        rng = random.Random(9)
        tokens = {"p": [rng.randrange(3, 900) for _ in range(8 * C)]}
        plans = cp.gen_plans([Batch((BatchRequest("p", tuple(tokens["p"])),))], [1])
        (tp,) = plans.transfer_plans
        peer = 1 - tp.home
        assert any(p.instance == peer for p in tp.puts), "some segments go to the peer"
        client = cluster.client(tp.home)
        kv = client.init_transfer(tp)
        kv.normal_()
        cluster.kill("transfer", peer)
        started = time.monotonic()
        with pytest.raises(EngineUnavailable, match=f"transfer engine of instance {peer}"):
            client.put(0, TINY.num_layers).wait()
        assert time.monotonic() - started < 5.0
        cp.abort(plans)
        assert cp.get_prefix_tree().match(tokens["p"]).hit_tokens == 0  # nothing visible
        assert cluster.failed_instances() == [peer]
        cluster.remove_instance(peer)
        cluster.restart_instance(peer)
        run_iteration(cluster, tokens, {"p": 8 * C})
        tokens["q"] = tokens["p"] + [5, 6]
        run_iteration(cluster, tokens, {"q": 2}, first_prefix={"q": 8 * C})
        cp.finish_request("p")
        cp.finish_request("q")
