"""vLLM on a TokenLake pool through ``TokenLakeConnector`` (issue #18).

A pool for vLLM's pages (``kv_layout="vllm-cpu"``, C = 128 = vLLM's CPU block size) is
served from this process; two vLLM engines, one after the other, each in a process of
its own, load the connector. The first stores a long document's segments; the second,
asking another question about the same document, loads them from the pool, and its
greedy output equals the reference engine's (which equals vLLM's without a connector,
tests/test_vllm.py)."""

from __future__ import annotations

import time

import pytest
import vllm_worker
from service_util import control_served
from vllm_worker import connector_config

pytest.importorskip("vllm")  # the connector is a vLLM class

C = 128


@pytest.fixture(scope="module")
def pool(smollm2):
    spec = smollm2[0].config.to_model_spec("smollm2-135m")
    with control_served(spec, 2, 96 << 20, C, 1024, "vllm-cpu") as served:
        yield served


def run_vllm(model_dir, prompts, max_tokens, address=None, timeout_s=10.0,
             loads_fail=False) -> list[list[int]]:
    """Greedy outputs of a vLLM process; asserts that its loads from the pool all
    succeeded (or, with ``loads_fail``, that one failed and was computed instead)."""
    cfg = None if address is None else connector_config(address, timeout_s=timeout_s)
    outputs, stderr = vllm_worker.run(model_dir, prompts, max_tokens, cfg)
    assert ("loading from the pool failed" in stderr) == loads_fail, stderr[-4000:]
    return outputs


def transfer_requests(cluster, server) -> int:
    """Requests the pool's transfer engines have served (``READ_SEGMENT`` among them),
    once the last vLLM's session has ended (its closing is served, not counted later)."""
    deadline = time.monotonic() + 15
    while server.sessions.infos() and time.monotonic() < deadline:
        time.sleep(0.1)
    return sum(p.requests for (role, _), p in cluster.engine_stats().items() if role == "transfer")


def stored_then_loaded(smollm2, smollm2_hf, pool, records: int) -> int:
    """A first vLLM stores a document (whole segments, so the second stores nothing), a
    second asks another question about it and loads it from the pool; both answer as
    the reference does. Returns the transfer engines' requests during the second."""
    _, tok, ref = smollm2
    cluster, server = pool
    doc = tok.encode(" ".join(f"Record {i}: the tide gauge at pier {(i * records) % 7} read "
                              f"{(i * 37 + records) % 100} centimetres." for i in range(records)))
    doc = doc[:len(doc) // C * C]
    assert len(doc) >= 5 * C
    first = doc + tok.encode(" Question: which pier is named most often?")
    second = doc + tok.encode(" Question: what did record 12 read?")
    out_a = run_vllm(smollm2_hf, [first], 8, server.address)
    stats = cluster.control.stats()
    stored = stats.pool.segments
    assert stored >= len(doc) // C, "the first engine stored the document's segments"
    before = transfer_requests(cluster, server)
    out_b = run_vllm(smollm2_hf, [second], 8, server.address)
    served = transfer_requests(cluster, server) - before
    after = cluster.control.stats()
    assert after.hit_tokens - stats.hit_tokens >= (len(doc) // C) * C - C, \
        "the second engine leased the document's segments"
    assert out_a[0] == ref.generate(first, 8, stop_ids=()).output_ids
    assert out_b[0] == ref.generate(second, 8, stop_ids=()).output_ids
    assert cluster.control.live_requests == ()  # every lease released
    cluster.control.check()
    return served


def test_a_second_vllm_loads_the_prefix_the_first_stored(smollm2, smollm2_hf, pool):
    """On the pool's machine the slabs are read in place: the transfer engines serve one
    READ_SEGMENT per instance read (the last layer, the lease's check), not one per layer."""
    served = stored_then_loaded(smollm2, smollm2_hf, pool, 60)
    assert served < smollm2[0].config.num_layers, served


def test_a_slab_not_offered_is_read_by_message(smollm2, smollm2_hf, pool, monkeypatch):
    """``TOKENLAKE_LOAD_IN_PLACE=0`` (as where the slab cannot be mapped: another host, a
    GPU pool): every layer is a READ_SEGMENT, and the answers are the same."""
    monkeypatch.setenv("TOKENLAKE_LOAD_IN_PLACE", "0")
    served = stored_then_loaded(smollm2, smollm2_hf, pool, 55)
    assert served >= smollm2[0].config.num_layers, served


def test_a_pool_that_dies_before_the_load_makes_vllm_compute(smollm2, smollm2_hf, pool):
    """The transfer engines that hold the segments are gone when the second engine loads:
    its reads fail within the connector's timeout, it reports the blocks as load errors,
    vLLM computes them, and the answer is still the reference's."""
    _, tok, ref = smollm2
    cluster, server = pool
    doc = tok.encode(" ".join(f"Line {i} of the harbour log notes {(i * 53) % 97} ships."
                              for i in range(50)))
    first, second = doc + tok.encode(" Summarise."), doc + tok.encode(" Which line is last?")
    run_vllm(smollm2_hf, [first], 4, server.address)
    for instance in (0, 1):
        cluster.kill("transfer", instance)
    out = run_vllm(smollm2_hf, [second], 8, server.address, timeout_s=2.0, loads_fail=True)
    assert out[0] == ref.generate(second, 8, stop_ids=()).output_ids
    for instance in cluster.failed_instances():  # leave the pool whole for other tests
        cluster.remove_instance(instance)
        cluster.restart_instance(instance)


def test_the_connector_refuses_a_pool_of_another_layout_or_segment_size(pool, smollm2):
    """A pool of TokenLake's own KV layout (another namespace), of another model's KV
    shape, or with segments that are not whole vLLM blocks is refused at start-up, before
    anything is read or stored."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tokenlake.core.errors import ConfigError
    from tokenlake.deploy.local import LocalCluster
    from tokenlake.integrations.vllm import TokenLakeConnector
    from tokenlake.service.server import ControlServer

    def config(address, block_size=C):
        return SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config={
                "address": address, "credentials": server.credentials()}),
            cache_config=SimpleNamespace(block_size=block_size))

    spec = smollm2[0].config.to_model_spec("smollm2-135m")
    with LocalCluster(1, spec, 16 << 20, segment_tokens=C, max_rows=128) as own, \
            ControlServer(own) as server:
        with pytest.raises(ConfigError, match="not vLLM's pages"):
            TokenLakeConnector(config(server.address), KVConnectorRole.SCHEDULER)
    _, served = pool
    other = SimpleNamespace(num_hidden_layers=24, num_key_value_heads=3, head_dim=64)
    cfg = config(served.address)
    cfg.kv_transfer_config.kv_connector_extra_config["credentials"] = served.credentials()
    cfg.model_config = SimpleNamespace(hf_config=other)
    with pytest.raises(ConfigError, match="another model"):
        TokenLakeConnector(cfg, KVConnectorRole.SCHEDULER)
    with pytest.raises(ConfigError, match="not whole vLLM blocks"):
        TokenLakeConnector(SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config={
                "address": served.address, "credentials": served.credentials()}),
            cache_config=SimpleNamespace(block_size=96)), KVConnectorRole.WORKER)
