"""The disk tier end to end: a LocalCluster whose transfer engines write every segment
through to a tier directory, a document pushed out of the slab by another, then asked
about again: its segments come back from the tier files, and the answer equals the
reference engine's. A corrupt file is refused, never read: its segments are computed
again, with the same answer.

The control plane's side (write-through, the tier's LRU, promotion order, failures)
is tested on its own in tests/test_tier_pool.py, the file store in
tests/test_tier_files.py."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from test_serving import NEW, C, _prompts
from tiny_model import model_spec, pool_bytes, reference

from tokenlake.core.errors import ConfigError, EngineUnavailable
from tokenlake.deploy.config import ClusterConfig
from tokenlake.deploy.local import LocalCluster
from tokenlake.engines.tier_files import SUFFIX
from tokenlake.generation import GenerationLoop, GenerationRequest

SLOTS = 5  # a request here ends with 4 segments and an open tail: the next one evicts it


def _other(tok):
    return tuple(tok.apply_chat_template([{"role": "user", "content": (
        "Kestrel Bay is a wide harbour of grey stone where boats from the north islands land "
        "their catch each morning before the markets open. What do the boats bring?")}]))


def _config(weights, tmp_path, instances: int = 1, slots: int = SLOTS, medium: str = "disk",
            **fields) -> ClusterConfig:
    """A pool of ``slots`` segments per instance with a tier of 64 in ``tmp_path/tier``
    (``medium`` "disk") or in host memory ("memory")."""
    return ClusterConfig(instances, model_spec(weights), pool_bytes(weights, C, slots), segment_tokens=C,
                         max_rows=512, tier_path=str(tmp_path / "tier") if medium == "disk" else None,
                         tier_bytes=pool_bytes(weights, C, 64), **fields)


def _ask(server, rid, prompt, tok):
    server.run([GenerationRequest(rid, prompt, NEW, (tok.eos_id,))])
    assert server.prefixes_lost == 0, "one client: what a request matched is there at its admission"
    return server.results[rid]


@pytest.fixture
def tiered(tiny_llama, tmp_path):
    weights, tok, _ = tiny_llama
    config = _config(weights, tmp_path)
    with LocalCluster(config) as cluster:
        yield cluster, GenerationLoop(cluster, weights, chunk_tokens=64, keep_logits=True)


def _same(got, want):
    assert got.output_ids == list(want.output_ids)


@pytest.mark.parametrize("medium", ["disk", "memory"])
def test_a_document_pushed_out_of_the_slab_comes_back_from_the_tier(tiny_llama, tmp_path, medium):
    weights, tok, _ = tiny_llama
    with LocalCluster(_config(weights, tmp_path, medium=medium)) as cluster:
        server = GenerationLoop(cluster, weights, chunk_tokens=64)
        _pushed_out_and_back(cluster, server, weights, tok)
    assert (tmp_path / "tier").exists() == (medium == "disk")


def _pushed_out_and_back(cluster, server, weights, tok) -> None:
    ref = reference(weights)
    doc, other = _prompts(tok)[0], _other(tok)
    first = _ask(server, "a", doc, tok)
    _ask(server, "b", other, tok)  # its segments take the slab: the document's are demoted
    tier = cluster.control.stats().pool.tier
    assert tier.demotions > 0 and tier.written >= len(doc) // C
    m = cluster.control.get_prefix_tree().match(doc, max_tokens=len(doc) - 1)
    assert m.tier_keys, "the document is held only in the tier"
    again = _ask(server, "a2", doc, tok)
    assert server.promotions >= len(m.tier_keys)
    assert again.hit_tokens >= len(m.tier_keys) * C  # read from the pool, not computed
    want = ref.generate(list(doc), NEW, stop_ids=(tok.eos_id,))
    _same(first, want)
    _same(again, want)
    assert cluster.control.stats().pool.tier.promotions >= len(m.tier_keys)
    cluster.control.check()


def test_other_requests_go_on_while_a_document_is_read_back_from_the_tier(tiny_llama, tmp_path):
    """The reads of a promotion run beside the serving loop: while a document's
    segments are held up on their way back from the tier, another request is served
    to its end; then the document's question is answered from the read-back segments,
    as the reference engine answers it."""
    import threading
    import time

    weights, tok, _ = tiny_llama
    doc, other = _prompts(tok)[0], _other(tok)
    with LocalCluster(_config(weights, tmp_path, medium="memory")) as cluster:
        server = GenerationLoop(cluster, weights, chunk_tokens=64)
        _ask(server, "a", doc, tok)
        _ask(server, "b", other, tok)  # pushes the document out of the slab
        tier_keys = cluster.control.get_prefix_tree().match(doc, max_tokens=len(doc) - 1).tier_keys
        assert tier_keys
        driver = cluster.control.tier_data_plane
        read, gate, started = driver.tier_read, threading.Event(), threading.Event()

        def held_up(promotions, **kw):
            started.set()
            assert gate.wait(120), "the read was never let through"
            return read(promotions, **kw)

        driver.tier_read = held_up
        plain = tuple(tok.encode("Grey stone boats land their catch before the markets open."))
        server.submit(GenerationRequest("a2", doc, NEW, (tok.eos_id,)))
        server.submit(GenerationRequest("c", plain, NEW, (tok.eos_id,)))
        deadline = time.monotonic() + 120
        while server.results["c"].finish_reason is None:
            assert time.monotonic() < deadline, "the other request was not served meanwhile"
            server.step()
        assert started.wait(60) and not server.results["a2"].output_ids, "a2 went on unread"
        gate.set()
        while server.busy:
            server.step()
        assert server.promotions >= len(tier_keys)
        assert server.results["a2"].hit_tokens >= len(tier_keys) * C
        cluster.control.check()
    ref = reference(weights)
    _same(server.results["a2"], ref.generate(list(doc), NEW, stop_ids=(tok.eos_id,)))
    _same(server.results["c"], ref.generate(list(plain), NEW, stop_ids=(tok.eos_id,)))


def test_a_corrupt_tier_file_is_refused_and_the_segment_computed_again(tiny_llama, tiered, tmp_path):
    weights, tok, _ = tiny_llama
    cluster, server = tiered
    doc, other = _prompts(tok)[0], _other(tok)
    _ask(server, "a", doc, tok)
    _ask(server, "b", other, tok)
    m = cluster.control.get_prefix_tree().match(doc, max_tokens=len(doc) - 1)
    assert m.tier_keys
    first = tmp_path / "tier" / "instance-0" / f"{m.tier_keys[0].hex()}{SUFFIX}"
    _wait_for(first)
    raw = bytearray(first.read_bytes())
    raw[-1] ^= 0xFF  # one flipped bit of K/V: the digest no longer matches
    first.write_bytes(bytes(raw))
    again = _ask(server, "a2", doc, tok)
    tier = cluster.control.stats().pool.tier
    assert tier.failed_promotions >= 1
    assert tier.engines[0]["read_failures"] >= 1  # the engine's own count, with its answers
    assert again.hit_tokens < len(m.tier_keys) * C  # computed, not read
    _same(again, reference(weights).generate(list(doc), NEW, stop_ids=(tok.eos_id,)))
    assert not first.exists() or first.read_bytes() != bytes(raw), "the corrupt file was kept"
    cluster.control.check()


def serve_recovering(server, after_step=lambda: None, most: int = 2) -> None:
    """Steps ``server`` until it is idle, replacing a dead engine's instance each time a
    step says one is gone (at most ``most`` times); ``after_step()`` after each step."""
    failures = 0
    while server.busy:
        try:
            server.step()
        except EngineUnavailable:
            failures += 1
            assert failures <= most
            server.recover()
        after_step()


def _wait_for(path: Path) -> None:
    """The tier writes in the background: a file may land after the segment left the
    slab (a read would find it staged). Corrupting a file needs it on disk."""
    import time

    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} was never written"
        time.sleep(0.05)


def test_the_tier_outlives_the_pool(tiny_llama, tmp_path):
    """A pool stopped and started again on its tier directory finds the segments
    written through before: held only in the tier, read back for the same question."""
    weights, tok, _ = tiny_llama
    doc = _prompts(tok)[0]
    config = _config(weights, tmp_path)
    with LocalCluster(config) as cluster:
        _ask(GenerationLoop(cluster, weights, chunk_tokens=64), "a", doc, tok)
        written = cluster.control.stats().pool.tier.written
    with LocalCluster(config) as cluster:
        m = cluster.control.get_prefix_tree().match(doc, max_tokens=len(doc) - 1)
        assert m.keys == () and len(m.tier_keys) == written  # all of it, only in the tier
        server = GenerationLoop(cluster, weights, chunk_tokens=64)
        again = _ask(server, "a", doc, tok)
        assert server.promotions == len(m.tier_keys) and again.hit_tokens >= len(m.tier_keys) * C
        cluster.control.check()
    _same(again, reference(weights).generate(list(doc), NEW, stop_ids=(tok.eos_id,)))


def test_a_tier_needs_room_for_a_segment_and_a_directory_its_size(tiny_llama, tmp_path):
    weights, _, _ = tiny_llama
    spec = model_spec(weights)
    with pytest.raises(ConfigError, match="needs tier_bytes"):
        ClusterConfig(1, spec, pool_bytes(weights, C, 4), segment_tokens=C, tier_path=str(tmp_path))
    for path in (str(tmp_path), None):  # on disk or in host memory
        with pytest.raises(ConfigError, match="holds no"):
            ClusterConfig(1, spec, pool_bytes(weights, C, 4), segment_tokens=C, tier_path=path, tier_bytes=10)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    huge = ClusterConfig(2, spec, pool_bytes(weights, C, 4), segment_tokens=C, tier_bytes=ram // 2)
    with pytest.raises(ConfigError, match="more than 80% of this machine"):
        LocalCluster(huge)  # refused before anything starts
    LocalCluster(dataclasses.replace(huge, tier_path=str(tmp_path)))  # on a disk: nothing to check


def test_serve_settings_give_the_pool_its_tier(tmp_path):
    from tokenlake.deploy.tier import tier_spec
    from tokenlake.tools.cli.pool import serve_config, tier_settings
    from tokenlake.tools.config import ServeSettings

    cfg = ServeSettings(tier_path=str(tmp_path), tier_mb=64)
    cluster = serve_config(cfg).cluster
    assert cluster.tier_path == str(tmp_path) and cluster.tier_bytes == 64 << 20
    assert cluster.tier_write_bw == 1 << 30  # the writer's bandwidth, bounded by default
    paced = serve_config(ServeSettings(tier_path=str(tmp_path), tier_mb=64, tier_write_mbps=5)).cluster
    assert tier_spec(paced, "transfer", 1)["tier_write_bw"] == 5 << 20  # what the engine is given
    # serve --ray hands RayCluster the same fields
    assert tier_settings(ServeSettings(tier_path=str(tmp_path), tier_mb=64, tier_write_mbps=5)) == {
        "tier_bytes": 64 << 20, "tier_path": str(tmp_path), "tier_write_bw": 5 << 20}
    assert "tier_write_bw" not in tier_spec(paced, "query", 1)
    none = serve_config(ServeSettings()).cluster
    assert none.tier_path is None and none.tier_bytes == 0
    memory = serve_config(ServeSettings(tier_mb=32)).cluster  # without a directory: host memory
    assert memory.tier_path is None and memory.tier_bytes == 32 << 20
    with pytest.raises(ConfigError, match="needs tier_mb"):
        ServeSettings(tier_path=str(tmp_path))


def test_metrics_status_and_the_wire_report_both_tiers(capsys):
    """The tier's counters, from a control plane that demoted and promoted, reach
    /metrics, `tokenlake status` and the control port's stats message intact."""
    import random

    from dataplane_util import TINY
    from test_tier_pool import store

    from tokenlake.core.config import PoolConfig
    from tokenlake.core.control import ControlPlane
    from tokenlake.dataplane.messages import CpStatsResult, decode
    from tokenlake.service.metrics import ServiceMetrics
    from tokenlake.tools.cli.status import print_status, status_summary

    cp = ControlPlane(PoolConfig(2, "t", 2, vnodes=8, page_tokens=2, tier_slots=6), TINY, [0],
                      clock=lambda: 0.0, rng=random.Random(0))
    store(cp.pool, [1, 2, 3, 4])
    store(cp.pool, [5, 6, 7, 8])  # the first document is demoted
    assert cp.promote([([1, 2, 3, 4, 9], None)]) == 2  # back in, the second one demoted
    # as a driver reports its transfer engines' counters (TierDone.counters) at a flush
    cp.pool.tier.engines = {0: {"written": 6.0, "write_errors": 1.0, "read_failures": 2.0,
                                "staged_bytes": 4096.0, "paced_s": 1.5}}
    stats = cp.stats()
    text = ServiceMetrics(lambda: stats, [0]).render().decode()
    for line in ('tokenlake_tier_segments{instance="0"} 4.0', "tokenlake_tier_demotions_total 4.0",
                 "tokenlake_tier_promotions_total 2.0", "tokenlake_tier_capacity_segments 6.0",
                 'tokenlake_tier_write_errors_total{instance="0"} 1.0',
                 'tokenlake_tier_read_failures_total{instance="0"} 2.0',
                 'tokenlake_tier_staged_bytes{instance="0"} 4096.0',
                 'tokenlake_tier_write_wait_seconds_total{instance="0"} 1.5',
                 'tokenlake_tier_refused_total{instance="0"} 0.0'):
        assert line in text
    _, back = decode(CpStatsResult(stats, (0,), "t", 2).encode(1))
    assert back.stats.pool.tier == stats.pool.tier
    summary = status_summary(back.stats)
    assert summary["tier"]["promotions"] == 2 and summary["tier"]["held"] == {"0": 4}
    assert summary["tier"]["engines"]["0"]["paced_s"] == 1.5
    print_status(summary, "tcp://x")
    out = capsys.readouterr().out
    assert "tier: 6 segments per instance, held {0: 4}" in out
    assert "instance 0: wrote 6 (errors 1, refused 0)   read 0 (failed 2)" in out
    assert "waited 1.5 s on the write bandwidth" in out


def test_a_transfer_engine_killed_while_promoting_changes_no_answer(tiny_llama, tmp_path):
    """Two instances, the document held only in their tiers; one transfer engine dies
    just as its tier's segments are read back. Its promotions fail (nothing read is
    trusted), the loop recovers the instance, and the answer equals the reference's."""
    weights, tok, _ = tiny_llama
    doc, other = _prompts(tok)[0], _other(tok)
    config = _config(weights, tmp_path, instances=2, slots=SLOTS // 2 + 1, timeout_s=2.0)
    with LocalCluster(config) as cluster:
        server = GenerationLoop(cluster, weights, chunk_tokens=64)
        _ask(server, "a", doc, tok)
        _ask(server, "b", other, tok)
        m = cluster.control.get_prefix_tree().match(doc, max_tokens=len(doc) - 1)
        assert m.tier_keys
        victim = cluster.control.pool.tree.node(m.tier_keys[0]).tier
        driver = cluster.control.tier_data_plane
        read = driver.tier_read

        def kill_then_read(promotions, **kw):
            cluster.kill("transfer", victim)
            return read(promotions, **kw)

        driver.tier_read = kill_then_read
        server.submit(GenerationRequest("a2", doc, NEW, (tok.eos_id,)))
        serve_recovering(server, lambda: setattr(driver, "tier_read", read))
        assert cluster.control.stats().pool.tier.failed_promotions >= 1
        assert cluster.alive("transfer", victim)
        cluster.control.check()
    _same(server.results["a2"], reference(weights).generate(list(doc), NEW, stop_ids=(tok.eos_id,)))


def test_an_instance_killed_after_writing_through_comes_back_with_its_tier(tiny_llama, tmp_path):
    """A transfer engine is killed right after its segments were staged (its writer may
    be mid-file). The instance is replaced; its new transfer engine opens the same
    directory (a half-written file is refused there) and the control plane adopts what
    is whole: the document, pushed out of the slabs, is read back from both tiers, and
    the answer equals the reference's."""
    weights, tok, _ = tiny_llama
    doc, other = _prompts(tok)[0], _other(tok)
    config = _config(weights, tmp_path, instances=2, slots=SLOTS // 2 + 1, timeout_s=2.0)
    with LocalCluster(config) as cluster:
        server = GenerationLoop(cluster, weights, chunk_tokens=64)
        _ask(server, "a", doc, tok)
        held = dict(cluster.control.stats().pool.tier.held)
        victim = max(held, key=held.get)
        cluster.kill("transfer", victim)
        server.recover()  # the instance out, and back with new engines
        assert cluster.alive("transfer", victim)
        assert cluster.control.stats().pool.tier.held.get(victim, 0) > 0, "its tier adopted again"
        _ask(server, "b", other, tok)  # pushes the document out of the slabs
        before = server.promotions
        again = _ask(server, "a2", doc, tok)
        assert server.promotions > before
        cluster.control.check()
    _same(again, reference(weights).generate(list(doc), NEW, stop_ids=(tok.eos_id,)))
