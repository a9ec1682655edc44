"""vLLM in the connector's query mode (issue #18): the pooled prefix is attended in the
pool, never copied into vLLM.

A pool of vLLM's K/V rows (``kv_layout="hf"``, C = 64, not a multiple of vLLM's block
size: nothing is copied block-wise) is served from this process. Two vLLM engines, one
after the other, each in a process of its own and each attached to its own pool instance,
run with the connector in query mode. The first computes a long document and stores every
token; the second asks other questions about it, several at once: their prefix is found
in the pool, attended there layer by layer (the pool's query engines, with their
partials merged with vLLM's attention over the new tokens), and the greedy outputs equal
the reference engine's (which equals vLLM's own computation,
tests/test_vllm_connector.py::test_vllm_serves_the_export_with_the_reference_output)."""

from __future__ import annotations

import pytest
import vllm_worker
from service_util import control_served, restart_failed
from vllm_worker import connector_config, reference_outputs

pytest.importorskip("vllm")

C = 64
NO_PREFIX_CACHE = {"enable_prefix_caching": False, "async_scheduling": False}


@pytest.fixture(scope="module")
def pool(smollm2):
    spec = smollm2[0].config.to_model_spec("smollm2-135m")
    with control_served(spec, 2, 96 << 20, C, 2048, "hf") as served:
        yield served


@pytest.fixture(scope="module")
def engines(smollm2_hf, pool, tmp_path_factory):
    """Two vLLM engines with the connector in query mode, on instance 0 and on instance 1
    (started once for the module; each test asks about documents of its own). The first
    asks the pool's query engines for every layer (``TOKENLAKE_QUERY_IN_PLACE=0``, as where
    the slabs cannot be mapped: another host, a GPU pool); the second attends the slabs in
    place, as on the pool's machine by default."""
    address, logs = pool[1].address, tmp_path_factory.mktemp("vllm")
    specs = [dict(model_dir=smollm2_hf, log_path=logs / f"instance{i}.log", kwargs=NO_PREFIX_CACHE,
                  env=env, kv_config=connector_config(address, timeout_s=5.0, mode="query", instance=i))
             for i, env in ((0, {"TOKENLAKE_QUERY_IN_PLACE": "0"}), (1, None))]
    with vllm_worker.workers(*specs) as started:
        yield started


def test_a_second_vllm_attends_the_first_ones_document_in_the_pool(smollm2, pool, engines):
    _, tok, ref = smollm2
    cluster, server = pool
    doc = tok.encode(" ".join(f"Entry {i}: the lighthouse at cape {i % 5} logged "
                              f"{(i * 41) % 90} gulls." for i in range(40)))
    assert len(doc) > 6 * C
    questions = [tok.encode(" Question: which cape is logged most often?"),
                 tok.encode(" Question: what did entry 7 log?"),
                 tok.encode(" Question: how many gulls in entry 30?")]
    first, *others = (doc + q for q in questions)
    segments = cluster.control.stats().pool.segments
    served = query_handoffs(cluster)
    out_a, _ = engines[0].run([first], 12)
    before = cluster.control.stats()
    assert before.pool.segments - segments >= len(doc) // C, "the first engine stored the document"
    assert query_handoffs(cluster) - served >= 11 * spec_layers(smollm2), "asked the query engines"
    served = query_handoffs(cluster)
    out_b, _ = engines[1].run(others, 12)
    after = cluster.control.stats()
    assert query_handoffs(cluster) == served, "the second attended the slabs in place"
    hits = [lcp(first, p) // C * C for p in others]
    assert min(hits) >= len(doc) // C * C
    assert after.hit_tokens - before.hit_tokens == sum(hits), \
        "both questions found the document in the pool"
    # every prompt token after the hit went through a committed pool step (a step that
    # failed and fell back to vLLM alone would have been aborted, not counted)
    assert after.prefill_tokens - before.prefill_tokens >= \
        sum(len(p) - h for p, h in zip(others, hits))
    assert [out_a[0], *out_b] == reference_outputs(ref, doc, questions, 12)
    assert cluster.control.live_requests == ()  # every request released in the pool
    cluster.control.check()


def query_handoffs(cluster) -> int:
    """Queries the pool's query engines have served through the sessions' bells (every
    per-layer query on the pool's machine)."""
    return sum(p.handoffs for (role, _), p in cluster.engine_stats().items() if role == "query")


def spec_layers(smollm2) -> int:
    return smollm2[0].config.num_layers


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_query_mode_refuses_what_it_cannot_serve(pool, smollm2):
    """Refused at start-up, before anything is read or stored: vLLM's own prefix cache or
    asynchronous scheduling on, speculative decoding, an unknown mode, a pool instance that
    does not exist, a pool of vLLM's pages (the load mode's layout)."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tokenlake.core.errors import ConfigError
    from tokenlake.deploy.local import LocalCluster
    from tokenlake.integrations.vllm import TokenLakeConnector
    from tokenlake.kernels import native
    from tokenlake.service.server import ControlServer

    _, served = pool

    def connector(server=served, prefix_cache=False, async_sched=False, spec=None,
                  role=KVConnectorRole.SCHEDULER, **extra):
        cfg = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config={
                "address": server.address, "credentials": server.credentials(),
                "mode": "query", **extra}),
            cache_config=SimpleNamespace(block_size=128, enable_prefix_caching=prefix_cache),
            scheduler_config=SimpleNamespace(async_scheduling=async_sched),
            speculative_config=spec)
        return TokenLakeConnector(cfg, role)

    with pytest.raises(ConfigError, match="--no-enable-prefix-caching"):
        connector(prefix_cache=True)
    with pytest.raises(ConfigError, match="--no-async-scheduling"):
        connector(async_sched=True)
    with pytest.raises(ConfigError, match="speculative decoding"):
        connector(spec=SimpleNamespace(method="ngram"))
    with pytest.raises(ConfigError, match="mode must be one of"):
        connector(mode="copy")
    with pytest.raises(ConfigError, match="instance must be one of"):
        connector(instance=2)
    spec = smollm2[0].config.to_model_spec("smollm2-135m")
    with LocalCluster(1, spec, 16 << 20, segment_tokens=128, max_rows=128,
                      kv_layout="vllm-cpu") as pages, ControlServer(pages) as server:
        with pytest.raises(ConfigError, match="--kv-layout hf"):
            connector(server)
    with pytest.raises(ConfigError, match="bf16_products must be 0, 1 or 2"):
        connector(bf16_products=3)
    ok = connector()  # the same settings, corrected, are taken
    assert ok.mode == "query" and ok.home == 0
    ok.shutdown()
    kernel = native.load_prebuilt()
    if kernel is not None:  # the worker, which attends in place, takes bfloat16 products
        try:
            connector(bf16_products=2).shutdown()  # the scheduler side attends nothing
            assert kernel.bf16_products() == 0
            connector(bf16_products=2, role=KVConnectorRole.WORKER).shutdown()
            assert kernel.bf16_products() == 2
        finally:
            kernel.set_bf16_products(0)


def test_dead_query_engines_make_vllm_compute_never_answer_wrong(smollm2, pool, engines):
    """The pool's query engines are gone when the second engine runs: the control plane
    still finds the document and leases it, and the second engine, which attends in place,
    never asks them. Either its step's commit succeeds (the driver skips the dead engines
    when it retires the step's grants, and the slabs it read were whole: the instances
    had not been healed yet), or the pool healed an instance first and the commit is
    refused (the slab may have been zeroed under the read), or the next step cannot be
    planned: then the connector aborts the step's plans and reports the requests whose
    prefix only the pool held as load errors, and vLLM computes them itself. In every case
    the answers are the reference's (the refused commit's path is checked step by step in
    tests/test_vllm_query_rows.py)."""
    _, tok, ref = smollm2
    cluster, server = pool
    doc = tok.encode(" ".join(f"Note {i}: the ferry to isle {i % 6} carried {(i * 29) % 80} "
                              f"crates." for i in range(36)))
    first = doc + tok.encode(" Which isle gets most crates?")
    second = doc + tok.encode(" What did note 9 carry?")
    engines[0].run([first], 4)
    before = cluster.control.stats()
    for instance in (0, 1):
        cluster.kill("query", instance)
    (out,), _stderr = engines[1].run([second], 8)
    assert out == ref.generate(second, 8, stop_ids=()).output_ids
    assert cluster.control.stats().hit_tokens > before.hit_tokens  # the prefix was leased
    assert cluster.control.live_requests == ()
    restart_failed(cluster, server)  # leave the pool whole for other tests


def test_vllms_openai_server_in_query_mode_on_a_served_pool(smollm2, smollm2_hf, tmp_path):
    """The README's commands: a pool served for vLLM (``serve_local``, what ``tokenlake
    serve --kv-layout hf`` runs) and vLLM's OpenAI-compatible server with the connector in
    query mode. A second question about a document finds it in the pool (vLLM's own prefix
    cache is off), and both completions are the reference's text."""
    import httpx
    from service_util import serving_locally

    import tokenlake
    from tokenlake.tools.bench.vllm import _free_port, _server, _stop, _wait_ready

    weights, tok, ref = smollm2
    spec = weights.config.to_model_spec("smollm2-135m")
    doc = tok.encode(" ".join(f"Log {i}: the weir at mill {i % 4} held {(i * 23) % 70} cm."
                              for i in range(30)))
    questions = [tok.encode(" Which mill is named first?"), tok.encode(" What did log 11 hold?")]
    prompts = [doc + q for q in questions]
    with serving_locally(spec, 2, 48 << 20, 128, 2048, control_port=0, http_port=0,
                         kv_layout="hf") as served:
        address = served.info()["address"]
        port = _free_port()
        proc = _server(smollm2_hf, port, address, tmp_path / "vllm.log", "query", 0)
        try:
            # the reference's answers while vLLM starts (its processes start one after
            # the other, each importing vLLM on one core: the other one is free)
            want = [tok.decode(out) for out in reference_outputs(ref, doc, questions, 10)]
            _wait_ready(port, proc)
            texts = []
            for prompt in prompts:
                body = {"model": str(smollm2_hf), "prompt": prompt, "max_tokens": 10,
                        "temperature": 0, "ignore_eos": True}
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300)
                r.raise_for_status()
                texts.append(r.json()["choices"][0]["text"])
        finally:
            _stop(proc)
        with tokenlake.connect(address) as cp:
            stats = cp.stats()
    assert stats.hit_tokens >= len(doc) // 128 * 128, "the second question found the document"
    assert texts == want
