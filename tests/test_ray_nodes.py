"""A RayCluster over two Ray nodes started on this machine (Ray's own
``cluster_utils.Cluster``: a head and a worker raylet): one instance per node, engines
binding the node's address with CURVE on, a DoP 2 prefill whose two halves compute on
the two nodes' compute actors, and outputs equal to the reference (issue #20)."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from scheduler.baselines.fcfs import FCFS  # noqa: E402
from tokenlake.deploy.ray import RayCluster, RayComputeEngine, RayOptions  # noqa: E402
from tokenlake.serving import GenerationRequest, Server  # noqa: E402

pytestmark = pytest.mark.ray

NEW = 4


@pytest.fixture(scope="module")
def two_nodes():
    """A head node and a worker node, one CPU each, and this process as their driver."""
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        nodes.add_node(num_cpus=1)
        nodes.wait_for_nodes()
        ray.init(address=nodes.address, log_to_driver=False, logging_level="ERROR")
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()


def test_a_dop_2_prefill_across_two_nodes_equals_the_reference(two_nodes, smollm2):
    weights, tok, ref = smollm2
    spec = weights.config.to_model_spec("smollm2-135m")
    options = RayOptions(host="node", strategy="STRICT_SPREAD", cpus_per_instance=1.0, engine_share=0.5)
    doc = "The river Lumen runs 212 km from the Grey Hills to Kestrel Bay."
    prompts = [tuple(tok.apply_chat_template([{"role": "user", "content": f"{doc} {q}"}]))
               for q in ("How long is it?", "Where does it end?")]
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
        server = Server(cluster, weights, chunk_tokens=64, keep_logits=True, policy=FCFS(64, prefill_dop=2))
        assert isinstance(server.engine, RayComputeEngine)
        for i, p in enumerate(prompts):  # the second reuses the first's prefix across nodes
            server.run([GenerationRequest(f"n{i}", p, NEW, (tok.eos_id,))])
        runs = dict(server.engine.batches_run)
    prefills = [b for d in server.decisions for b in d.batches if b.phase == "prefill"]
    assert prefills and all(b.dop == 2 for b in prefills)
    assert set(runs) == {0, 1}
    assert server.results["n1"].hit_tokens > 0
    for i, prompt in enumerate(prompts):
        expected = ref.generate(list(prompt), NEW, stop_ids=(tok.eos_id,))
        assert server.results[f"n{i}"].output_ids == list(expected.output_ids)
        for got, want in zip(server.results[f"n{i}"].logits, expected.logits):
            assert (got - want).abs().max().item() < 1e-4
