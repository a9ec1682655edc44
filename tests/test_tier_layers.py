"""Promotions read layer by layer and attended while they come in.

From the bottom up: the tier's files read a layer at a time, each layer checked before
it is reported (``TierFiles.get_layers_into``); a transfer engine's layered
``TIER_READ`` answering with ``TIER_PROGRESS`` before its ``TIER_DONE``; the serving
loop's gate (``ReadGate``); and a real pool whose compute engine attends the first layer
of a document read back from the disk tier before its other layers are in, with the
answer equal to the reference engine's, and a file corrupt in its last layer that fails
the iteration, not the request."""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import select
import threading

import pytest
from test_serving import NEW, C, _prompts
from test_tier import _ask, _config, _other, _same, _wait_for, serve_recovering
from test_tier_serving import _Engine
from tiny_model import reference

from tokenlake.core.errors import EngineUnavailable, TierReadFailed
from tokenlake.dataplane import messages
from tokenlake.dataplane.messages import TierDone, TierProgress, TierRead
from tokenlake.deploy.local import LocalCluster
from tokenlake.engines.tier_files import SUFFIX, TierFiles
from tokenlake.generation import GenerationLoop, GenerationRequest
from tokenlake.generation.tier_reads import ReadGate

LAYERS, LAYER = 4, 256  # bytes of one layer of a segment in the file tests


def _segment(seed: int) -> bytes:
    return bytes((seed * 7 + i) % 251 for i in range(LAYERS * LAYER))


def _corrupt(path, at: int) -> None:
    """Flips the byte ``at`` bytes before the file's end (its last layer holds the last
    ``LAYER``)."""
    raw = bytearray(path.read_bytes())
    raw[-at] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_segments_are_read_a_layer_of_each_at_a_time_and_each_layer_checked(tmp_path):
    with TierFiles(tmp_path, 1 << 20, {}, fsync=False, chunk_bytes=LAYER) as files:
        keys = [bytes([i]) * 16 for i in range(3)]
        for i, k in enumerate(keys):
            files.put(k, _segment(i))
        outs = [bytearray(LAYERS * LAYER) for _ in keys]
        seen = []
        assert files.get_layers_into(list(zip(keys, outs)), LAYERS, seen.append) == [True] * 3
        assert seen == [1, 2, 3, 4]
        assert [bytes(o) for o in outs] == [_segment(i) for i in range(3)]

        _corrupt(tmp_path / (keys[1].hex() + SUFFIX), LAYER + 1)  # its layer 2 of 0..3
        seen.clear()
        outs = [bytearray(LAYERS * LAYER) for _ in keys]
        assert files.get_layers_into(list(zip(keys, outs)), LAYERS, seen.append) == [True, False, True]
        assert seen == [1, 2, 2, 2], "no layer more is reported once one of them failed"
        assert bytes(outs[0]) == _segment(0) and bytes(outs[2]) == _segment(2), "the others read on"
        assert keys[1] not in files and not (tmp_path / (keys[1].hex() + SUFFIX)).exists()

        seen.clear()
        assert files.get_layers_into([(keys[1], bytearray(LAYERS * LAYER))], LAYERS, seen.append) == [False]
        assert seen == [0] * LAYERS  # (every layer, as the driver's clock)


def test_a_long_document_is_read_in_groups_of_open_files_only_the_last_reporting_layers(tmp_path, monkeypatch):
    import tokenlake.engines.tier_layers as tier_layers

    monkeypatch.setattr(tier_layers, "MAX_OPEN", 2)
    with TierFiles(tmp_path, 1 << 20, {}, fsync=False, chunk_bytes=LAYER) as files:
        keys = [bytes([i]) * 16 for i in range(5)]
        for i, k in enumerate(keys):
            files.put(k, _segment(i))
        outs, seen = [bytearray(LAYERS * LAYER) for _ in keys], []
        assert files.get_layers_into(list(zip(keys, outs)), LAYERS, seen.append) == [True] * 5
        assert seen == [0] * 2 * LAYERS + [1, 2, 3, 4], "a layer is in only once every group has it"
        assert [bytes(o) for o in outs] == [_segment(i) for i in range(5)]


def test_a_file_chunked_otherwise_is_read_whole_before_the_layers_are_reported(tmp_path):
    with TierFiles(tmp_path, 1 << 20, {}, fsync=False, chunk_bytes=3 * LAYER) as files:
        files.put(b"k" * 16, _segment(5))
    with TierFiles(tmp_path, 1 << 20, {}, fsync=False, chunk_bytes=LAYER) as files:
        out, seen = bytearray(LAYERS * LAYER), []
        assert files.get_layers_into([(b"k" * 16, out)], LAYERS, seen.append) == [True]
        assert bytes(out) == _segment(5) and seen == [1, 2, 3, 4]
        _corrupt(tmp_path / ((b"k" * 16).hex() + SUFFIX), 1)
        seen.clear()
        assert files.get_layers_into([(b"k" * 16, bytearray(LAYERS * LAYER))], LAYERS, seen.append) == [False]
        assert seen == [0] * LAYERS


def _serve_read(engine: _Engine, message: TierRead) -> list:
    """The engine's replies to ``message`` (read on its reader's thread) up to its answer."""
    engine.tier_request(b"", 1, message)
    while not any(r.kind == TierDone.KIND for r in engine.replies):
        assert select.select([engine._reader.fd], [], [], 30)[0], "no answer"
        engine._reader.drain()
    return [messages.parse(r) for r in engine.replies]


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_layered_read_reports_each_layer_before_its_answer(tmp_path, corrupt):
    engine = _Engine(tmp_path)
    try:
        slot_bytes = engine.slab[0].numel() * 4
        data = {bytes([i]) * 16: bytes((31 * i + j) % 256 for j in range(slot_bytes)) for i in (1, 2)}
        for k, v in data.items():
            engine.tier.files.put(k, v)
        if corrupt:  # the second segment's last layer
            _corrupt(tmp_path / ((bytes([2]) * 16).hex() + SUFFIX), 1)
        got = _serve_read(engine, TierRead(((bytes([1]) * 16, 0, -1), (bytes([2]) * 16, 3, -1)), 0, layered=True))
        assert [r.layers for r in got[:-1]] == ([1, 1] if corrupt else [1, 2]) and all(
            isinstance(r, TierProgress) for r in got[:-1])
        assert got[-1].failed == ((bytes([2]) * 16,) if corrupt else ())
        assert engine.slab[0].contiguous().view(-1).numpy().view("u1").tobytes() == data[bytes([1]) * 16]
        engine.replies.clear()
        plain = _serve_read(engine, TierRead(((bytes([1]) * 16, 1, -1),), 0))
        assert [type(r) for r in plain] == [TierDone], "no progress unless asked for"
    finally:
        engine.close_tier()


def _over(gate: ReadGate, failed: set) -> None:
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result((failed, {}))
    gate.finish(done)


def test_the_gate_opens_a_layer_once_every_reader_has_it_and_fails_once_the_reads_end_without_it():
    gate = ReadGate({0, 1}, 3, timeout_s=30.0)
    gate.layer_in(0, 2)
    waiter = threading.Thread(target=gate.wait, args=(0,))
    waiter.start()
    gate.layer_in(1, 1)
    waiter.join(30)
    assert not waiter.is_alive(), "layer 0 is in on both instances"
    _over(gate, {b"k"})
    with pytest.raises(TierReadFailed):
        gate.wait(1)  # instance 1 never said it had layer 1, and its reads are over

    whole = ReadGate({0}, 3, timeout_s=30.0)
    _over(whole, set())  # no progress came (a host-memory tier): the answer says all is in
    whole.wait(2)
    patient = ReadGate({0}, 3, timeout_s=None)  # reads that report no layers: no clock of its own
    later = threading.Timer(0.2, _over, args=(patient, set()))
    later.start()
    patient.wait(2)
    later.join()
    quiet = ReadGate({0}, 3, timeout_s=0.05)
    with pytest.raises(EngineUnavailable, match="silent"):
        quiet.wait(0)  # no word at all
    dead = ReadGate({0}, 3, timeout_s=30.0)
    gone: concurrent.futures.Future = concurrent.futures.Future()
    gone.set_result(({b"k"}, {b"k": 7}))  # its engine neither answered nor was fenced
    dead.finish(gone)
    with pytest.raises(EngineUnavailable, match="silent"):
        dead.wait(0)


@contextlib.contextmanager
def _in_the_tier(tiny_llama, tmp_path, **config):
    """A pool (``_config(**config)``) and its serving loop, the test document asked about
    and then pushed out of the slab by another: held only in the tier."""
    weights, tok, _ = tiny_llama
    with LocalCluster(_config(weights, tmp_path, **config)) as cluster:
        server = GenerationLoop(cluster, weights, chunk_tokens=64)
        _ask(server, "a", _prompts(tok)[0], tok)
        _ask(server, "b", _other(tok), tok)
        yield cluster, server


@pytest.mark.parametrize("instances", [1, 2])
def test_a_document_read_back_from_disk_is_attended_while_its_layers_come_in(
        tiny_llama, tmp_path, monkeypatch, instances):
    """The compute engine reaches layer 1 of the question's iteration while the read
    has reported layer 1 of nothing yet (the driver's thread holds the reports until
    then): it attended layer 0 first. The answer equals the reference's."""
    weights, tok, _ = tiny_llama
    doc, other = _prompts(tok)[0], _other(tok)
    at_layer_1 = threading.Event()
    wait = ReadGate.wait

    def watched(gate, layer):
        if layer == 1:
            at_layer_1.set()
        return wait(gate, layer)

    monkeypatch.setattr(ReadGate, "wait", watched)
    slots = 5 if instances == 1 else 3
    with LocalCluster(_config(weights, tmp_path, instances=instances, slots=slots)) as cluster:
        server = GenerationLoop(cluster, weights, chunk_tokens=64)
        _ask(server, "a", doc, tok)
        _ask(server, "b", other, tok)
        tier_keys = cluster.control.get_prefix_tree().match(doc, max_tokens=len(doc) - 1).tier_keys
        assert tier_keys
        driver = cluster.control.tier_data_plane
        read, reports = driver.tier_read, []

        def spied(promotions, on_layer=None):
            """The read, its reports of layer 1 (and on) held back, and its end, until
            the engine waits at layer 1: it can get there only by attending layer 0
            while the read goes on."""
            assert on_layer is not None, "a lone question's read is layered"
            held = queue.SimpleQueue()

            def report(inst, layers):
                reports.append((inst, layers))
                (held.put if layers >= 2 and not at_layer_1.is_set() else lambda r: on_layer(*r))((inst, layers))

            out = read(promotions, on_layer=report)
            assert at_layer_1.wait(60), "the engine waited for the whole read"
            while not held.empty():
                on_layer(*held.get())
            return out

        driver.tier_read = spied
        again = _ask(server, "a2", doc, tok)
        assert server.tier_reads.overlapped >= 1
        assert {inst for inst, _ in reports} == {cluster.control.pool.tree.node(k).tier for k in tier_keys}
        assert again.hit_tokens >= len(tier_keys) * C
        cluster.control.check()
    _same(again, reference(weights).generate(list(doc), NEW, stop_ids=(tok.eos_id,)))


def test_a_file_corrupt_in_its_last_layer_fails_the_iteration_and_the_question_is_computed(
        tiny_llama, tmp_path):
    weights, tok, _ = tiny_llama
    doc = _prompts(tok)[0]
    with _in_the_tier(tiny_llama, tmp_path) as (cluster, server):
        m = cluster.control.get_prefix_tree().match(doc, max_tokens=len(doc) - 1)
        last = tmp_path / "tier" / "instance-0" / f"{m.tier_keys[-1].hex()}{SUFFIX}"
        _wait_for(last)
        _corrupt(last, 1)
        corrupt = last.read_bytes()
        server.submit(GenerationRequest("a2", doc, NEW, (tok.eos_id,)))
        while server.busy:
            server.step()  # the failed read raises nothing here
        again = server.results["a2"]
        assert server.tier_reads.overlapped >= 1
        assert cluster.control.stats().pool.tier.failed_promotions >= 1
        assert again.hit_tokens < len(m.tier_keys) * C
        assert not last.exists() or last.read_bytes() != corrupt, "the corrupt file was kept"
        cluster.control.check()
    _same(again, reference(weights).generate(list(doc), NEW, stop_ids=(tok.eos_id,)))


def test_a_read_that_fails_after_its_last_layer_came_in_aborts_the_iteration(tiny_llama, tmp_path):
    """Every layer was reported, then the answer says the read failed (a file longer
    than its header, an engine silent after its last report): the iteration that
    attended it is aborted, not completed, so nothing it stored hangs under a segment
    that now leaves the tree; the question is computed again, with the reference's
    answer."""
    weights, tok, _ = tiny_llama
    doc = _prompts(tok)[0]
    with _in_the_tier(tiny_llama, tmp_path) as (cluster, server):
        tier_keys = cluster.control.get_prefix_tree().match(doc, max_tokens=len(doc) - 1).tier_keys
        driver = cluster.control.tier_data_plane
        read = driver.tier_read

        def failed_at_the_end(promotions, **kw):
            read(promotions, **kw)
            return {promotions[-1].key}, {}

        driver.tier_read = failed_at_the_end
        server.submit(GenerationRequest("a2", doc, NEW, (tok.eos_id,)))
        while server.busy:
            server.step()
            driver.tier_read = read
        assert server.tier_reads.overlapped >= 1
        assert cluster.control.stats().pool.tier.failed_promotions >= 1
        assert server.results["a2"].hit_tokens < len(tier_keys) * C, "computed again, without the failed one"
        cluster.control.check()
    _same(server.results["a2"], reference(weights).generate(list(doc), NEW, stop_ids=(tok.eos_id,)))


def test_a_pool_with_its_tier_in_host_memory_overlaps_nothing_and_answers_the_same(tiny_llama, tmp_path):
    """Host-memory tiers answer at once, with no progress: the gate opens on the answer."""
    weights, tok, _ = tiny_llama
    doc = _prompts(tok)[0]
    with _in_the_tier(tiny_llama, tmp_path, medium="memory") as (cluster, server):
        again = _ask(server, "a2", doc, tok)
        assert server.promotions >= 1 and server.tier_reads.overlapped >= 1
    _same(again, reference(weights).generate(list(doc), NEW, stop_ids=(tok.eos_id,)))


def test_the_benchmarks_tier_row_times_the_overlapped_and_the_whole_read_alternately(tiny_llama):
    """``tokenlake bench e2e --tier-serial``'s row on the tiny model: every round asks
    about its document from the tier once overlapped and once after the whole read, in
    alternating order, each time with the document's segments only in the tier; the
    overlapped answer equals the reference's."""
    from tokenlake.tools.bench.e2e import tagged_document
    from tokenlake.tools.bench.e2e_tier import bench_tier, summary

    weights, tok, _ = tiny_llama
    row = bench_tier(weights, tok, tagged_document, doc_tokens=300, rounds=2, chunk_tokens=64,
                     check_tokens=4, segment_tokens=64, serial=True)
    assert row["answer_equal_to_reference"] is True
    assert len(row["overlap_vs_serial_per_round"]) == 2 and row["overlap_vs_serial"] > 0
    assert all(h["only_in_tier"] > 0 and h["in_slab"] == 0 for h in row["segments_before_the_question"])
    assert all(n > 0 for n in row["promoted_segments"])
    assert "whole read first" in summary(row)


def test_a_transfer_engine_killed_between_two_layers_of_a_read_changes_no_answer(tiny_llama, tmp_path):
    """The transfer engine is killed when its report of layer 1 of the document comes
    in. Where it had not read the rest yet, the iteration attending the read stops at
    the next layer (no answer, no progress: the driver gives up after its timeout) with
    EngineUnavailable; where it had (these files are small), the next put finds it
    dead. Either way the loop replaces the instance and the answer is the reference's."""
    weights, tok, _ = tiny_llama
    doc = _prompts(tok)[0]
    with _in_the_tier(tiny_llama, tmp_path, timeout_s=2.0) as (cluster, server):
        driver = cluster.control.tier_data_plane
        read, killed = driver.tier_read, []

        def kill_after_layer_1(promotions, on_layer=None):
            def report(inst, layers):
                on_layer(inst, layers)
                if not killed:
                    killed.append(inst)
                    cluster.kill("transfer", inst)
            return read(promotions, on_layer=report if on_layer else None)

        driver.tier_read = kill_after_layer_1
        server.submit(GenerationRequest("a2", doc, NEW, (tok.eos_id,)))
        serve_recovering(server)
        assert killed and server.tier_reads.overlapped >= 1
        assert cluster.alive("transfer", 0)
        cluster.control.check()
    _same(server.results["a2"], reference(weights).generate(list(doc), NEW, stop_ids=(tok.eos_id,)))
