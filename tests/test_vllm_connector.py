"""vLLM on a TokenLake pool through ``TokenLakeConnector`` (issue #18).

A pool for vLLM's pages (``kv_layout="vllm-cpu"``, C = 128 = vLLM's CPU block size) is
served from this process; vLLM engines, each in a process of its own, load the
connector. First, prompts shorter than a segment, which the pool can neither hold nor
serve: vLLM computes them alone, and its greedy output on the exported model
(tests/test_vllm.py) equals the reference engine's. Then the first engine stores a long
document's segments; a second, asking another question about the same document, loads
them from the pool, and its greedy output equals the reference engine's too. The
engines are started once for the module (``vllm_worker.workers``) and each test uses its
own documents, so what a loading engine has is what it loaded from the pool."""

from __future__ import annotations

import pytest
import vllm_worker
from service_util import control_served, restart_failed
from vllm_worker import connector_config, reference_outputs

pytest.importorskip("vllm")  # the connector is a vLLM class

C = 128


@pytest.fixture(scope="module")
def pool(smollm2):
    spec = smollm2[0].config.to_model_spec("smollm2-135m")
    with control_served(spec, 2, 96 << 20, C, 1024, "vllm-cpu") as served:
        yield served


@pytest.fixture(scope="module")
def engines(smollm2_hf, pool, tmp_path_factory):
    """Two vLLM engines on the pool: ``in_place`` reads the slabs it loads in place,
    ``by_message`` has ``TOKENLAKE_LOAD_IN_PLACE=0`` (as where a slab cannot be mapped:
    another host, a GPU pool) and a 5 s timeout (the dying pool's test waits it out).
    Each test stores with one and loads with the other."""
    address, logs = pool[1].address, tmp_path_factory.mktemp("vllm")
    specs = [dict(model_dir=smollm2_hf, log_path=logs / f"{name}.log", env=env,
                  kv_config=connector_config(address, timeout_s=timeout_s))
             for name, env, timeout_s in (("in_place", None, 10.0),
                                          ("by_message", {"TOKENLAKE_LOAD_IN_PLACE": "0"}, 5.0))]
    with vllm_worker.workers(*specs) as started:
        yield dict(zip(("in_place", "by_message"), started))


def run_vllm(engine, prompts, max_tokens, loads_fail=False) -> list[list[int]]:
    """Greedy outputs of one of the ``engines``; asserts that its loads from the pool all
    succeeded (or, with ``loads_fail``, that one failed and was computed instead)."""
    outputs, log = engine.run(prompts, max_tokens)
    assert ("loading from the pool failed" in log) == loads_fail, log[-4000:]
    return outputs


def transfer_requests(cluster) -> int:
    """Requests the pool's transfer engines have served (``READ_SEGMENT`` among them)."""
    return sum(p.requests for (role, _), p in cluster.engine_stats().items() if role == "transfer")


def stored_then_loaded(smollm2, pool, store, load, records: int) -> int:
    """A first vLLM stores a document (whole segments, so the second stores nothing), a
    second asks another question about it and loads it from the pool; both answer as
    the reference does. Returns the transfer engines' requests during the second."""
    _, tok, ref = smollm2
    cluster, server = pool
    doc = tok.encode(" ".join(f"Record {i}: the tide gauge at pier {(i * records) % 7} read "
                              f"{(i * 37 + records) % 100} centimetres." for i in range(records)))
    doc = doc[:len(doc) // C * C]
    assert len(doc) >= 5 * C
    questions = [tok.encode(" Question: which pier is named most often?"),
                 tok.encode(" Question: what did record 12 read?")]
    first, second = (doc + q for q in questions)
    stored_before = cluster.control.stats().pool.segments
    out_a = run_vllm(store, [first], 8)
    stats = cluster.control.stats()
    assert stats.pool.segments - stored_before >= len(doc) // C, \
        "the first engine stored the document's segments"
    before = transfer_requests(cluster)
    out_b = run_vllm(load, [second], 8)
    served = transfer_requests(cluster) - before
    after = cluster.control.stats()
    assert after.hit_tokens - stats.hit_tokens >= (len(doc) // C) * C - C, \
        "the second engine leased the document's segments"
    assert [out_a[0], out_b[0]] == reference_outputs(ref, doc, questions, 8)
    assert cluster.control.live_requests == ()  # every lease released
    cluster.control.check()
    return served


def test_vllm_serves_the_export_with_the_reference_output(smollm2, pool, engines):
    """vLLM on the Hugging Face export of the shipped model: prompts shorter than one
    segment are neither found in the pool nor stored (the pool's counters do not move),
    so vLLM computes them alone, and its greedy output is the reference engine's."""
    _, tok, ref = smollm2
    cluster, _ = pool
    prompts = [tok.encode("The capital of France is"), tok.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}])]
    assert all(len(p) < C for p in prompts)
    before = cluster.control.stats()
    outputs = run_vllm(engines["in_place"], prompts, 8)
    after = cluster.control.stats()
    assert (after.pool.segments, after.hit_tokens) == (before.pool.segments, before.hit_tokens)
    for p, got in zip(prompts, outputs):
        assert got == ref.generate(p, 8, stop_ids=()).output_ids


def test_a_second_vllm_loads_the_prefix_the_first_stored(smollm2, pool, engines):
    """On the pool's machine the slabs are read in place: the transfer engines serve one
    READ_SEGMENT per instance read (the last layer, the lease's check), not one per layer."""
    served = stored_then_loaded(smollm2, pool, engines["by_message"], engines["in_place"], 60)
    assert served < smollm2[0].config.num_layers, served


def test_a_slab_not_offered_is_read_by_message(smollm2, pool, engines):
    """``TOKENLAKE_LOAD_IN_PLACE=0``: every layer is a READ_SEGMENT, and the answers are
    the same."""
    served = stored_then_loaded(smollm2, pool, engines["in_place"], engines["by_message"], 55)
    assert served >= smollm2[0].config.num_layers, served


def test_a_pool_that_dies_before_the_load_makes_vllm_compute(smollm2, pool, engines):
    """The transfer engines that hold the segments are gone when the second engine loads:
    its reads fail within the connector's timeout, it reports the blocks as load errors,
    vLLM computes them, and the answer is still the reference's."""
    _, tok, ref = smollm2
    cluster, server = pool
    doc = tok.encode(" ".join(f"Line {i} of the harbour log notes {(i * 53) % 97} ships."
                              for i in range(50)))
    first, second = doc + tok.encode(" Summarise."), doc + tok.encode(" Which line is last?")
    run_vllm(engines["in_place"], [first], 4)
    for instance in (0, 1):
        cluster.kill("transfer", instance)
    out = run_vllm(engines["by_message"], [second], 8, loads_fail=True)
    assert out[0] == ref.generate(second, 8, stop_ids=()).output_ids
    restart_failed(cluster, server)  # leave the pool whole for other tests


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
