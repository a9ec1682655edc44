"""A RayCluster over two Ray nodes on this machine (Ray's own ``cluster_utils.Cluster``:
the Ray modules' shared head of tests/ray_util.py and a worker raylet added for this
module): one instance per node, engines binding the node's address with CURVE on, a DoP
2 prefill whose two halves compute on the two nodes' compute actors, and outputs equal
to the reference (issue #20)."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

import ray_util  # noqa: E402

from scheduler.baselines.fcfs import FCFS  # noqa: E402
from tokenlake.deploy.ray import RayCluster, RayComputeEngine, RayOptions  # noqa: E402
from tokenlake.generation import GenerationLoop, GenerationRequest  # noqa: E402

pytestmark = pytest.mark.ray

NEW = ray_util.NEW

shared_ray = ray_util.shared_ray_fixture()


@pytest.fixture(scope="module")
def two_nodes(shared_ray):
    """The shared head node (2 CPUs) and a worker node of one CPU added to it (removed
    afterwards), and this process as their driver."""
    worker = shared_ray.add_node(num_cpus=1)
    try:
        shared_ray.wait_for_nodes()
        with ray_util.driver(shared_ray):
            yield shared_ray
    finally:
        shared_ray.remove_node(worker)


def test_a_dop_2_prefill_across_two_nodes_equals_the_reference(two_nodes, smollm2):
    weights, tok, ref = smollm2
    spec = weights.config.to_model_spec("smollm2-135m")
    options = RayOptions(host="node", strategy="STRICT_SPREAD", cpus_per_instance=1.0, engine_share=0.5)
    prompts = ray_util.short_prompts(tok)[:2]  # test_ray's: their reference outputs are computed once
    with RayCluster(2, spec, 48 << 20, segment_tokens=16, max_rows=512, start_timeout_s=120.0,
                    options=options, compute=True) as cluster:
        assert cluster.node_id(0) != cluster.node_id(1)  # one instance per node
        procs = cluster.processes()
        for i in (0, 1):
            assert procs[("compute", i)].node == cluster.node_id(i)
            info = cluster.client_info(i)
            assert info["keys"] is not None  # CURVE on
            host = info["endpoints"]["query"].split("//")[1].rsplit(":", 1)[0]
            assert host == procs[("query", i)].ip and not host.startswith("127.")
        server = GenerationLoop(cluster, weights, chunk_tokens=64, keep_logits=True, policy=FCFS(64, prefill_dop=2))
        assert isinstance(server.engine, RayComputeEngine)
        for i, p in enumerate(prompts):  # the second reuses the first's prefix across nodes
            server.run([GenerationRequest(f"n{i}", p, NEW, (tok.eos_id,))])
        runs = dict(server.engine.batches_run)
    prefills = [b for d in server.decisions for b in d.batches if b.phase == "prefill"]
    assert prefills and all(b.dop == 2 for b in prefills)
    assert set(runs) == {0, 1}
    assert server.results["n1"].hit_tokens > 0
    for i, prompt in enumerate(prompts):
        expected = ray_util.reference(ref, prompt, NEW, (tok.eos_id,))
        assert server.results[f"n{i}"].output_ids == list(expected.output_ids)
        for got, want in zip(server.results[f"n{i}"].logits, expected.logits):
            assert (got - want).abs().max().item() < 1e-4
