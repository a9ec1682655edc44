"""The vLLM connector's two modes as strategy objects, each built and driven alone: a
:class:`~tokenlake.integrations.vllm_mode.VllmPool` and
:class:`~tokenlake.integrations.vllm_mode.PoolRequests` over a recording fake of the pool
session, no vLLM engine and no pool. The connector (tokenlake/integrations/vllm.py)
only hands vLLM's calls to them; it runs end to end in tests/test_vllm_connector.py and
tests/test_vllm_query.py, and its scheduler side against a served pool in
tests/test_salts.py."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")  # the metadata classes derive from vLLM's

from tokenlake.core.errors import EngineUnavailable, PrefixNotCached  # noqa: E402
from tokenlake.core.tree_nodes import MatchResult, SegmentLocation  # noqa: E402
from tokenlake.integrations.vllm_load import LoadStrategy  # noqa: E402
from tokenlake.integrations.vllm_meta import FailedRequests, Load  # noqa: E402
from tokenlake.integrations.vllm_mode import ModeStrategy, PoolRequests, VllmPool  # noqa: E402
from tokenlake.integrations.vllm_query import QueryStrategy  # noqa: E402

C, BLOCK = 8, 4  # segments of two vLLM blocks


class FakeSession:
    """What the strategies call of ``tokenlake.connect``'s session, recorded."""

    timeout_s = 1.0

    def __init__(self, hit: int = 0, locations=(), lease_error: Exception | None = None) -> None:
        self.hit, self.locations, self.lease_error = hit, tuple(locations), lease_error
        self.calls: list[tuple] = []

    def get_prefix_tree(self):
        return SimpleNamespace(match=lambda prompt, max_tokens, salt: MatchResult(
            (), (), min(self.hit, max_tokens)))

    def lease_prefix(self, rid, tokens, salt):
        self.calls.append(("lease", rid, len(tokens), salt))
        if self.lease_error is not None:
            raise self.lease_error
        return self.locations

    def lease_grants(self, rid):
        return ((0, b"grant-" + rid.encode()),)

    def finish_request(self, rid):
        self.calls.append(("finish", rid))

    def gen_plans(self, batches, dops, homes):
        self.calls.append(("plan", batches, homes))
        (batch,) = batches
        spans = tuple(SimpleNamespace(request_id=r.request_id) for r in batch.requests)
        return SimpleNamespace(query_plans=(SimpleNamespace(spans=spans),), transfer_plans=())

    def plan_grants(self, plans):
        return ((b"q", b"t"),)

    def abort(self, plans):
        self.calls.append(("abort", plans))

    def client(self, instance):
        raise EngineUnavailable(f"instance {instance}'s engines are gone")


def build(strategy, session: FakeSession, salt: str | None = None):
    pool = VllmPool(session, home=0, segment_tokens=C, block_size=BLOCK, max_rows=64)
    requests = PoolRequests(session, salt)
    return strategy(pool, requests), requests


def request(rid: str, tokens: int, salt=None):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(tokens)),
                           all_token_ids=list(range(tokens)), cache_salt=salt)


def blocks(*ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def step(new: dict[str, int]):
    """A scheduler output with no new requests and ``new`` tokens of cached ones."""
    cached = SimpleNamespace(req_ids=list(new), new_block_ids=[None] * len(new),
                             resumed_req_ids=set(), num_computed_tokens=[0] * len(new))
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens=dict(new))


@pytest.mark.parametrize("strategy", [LoadStrategy, QueryStrategy])
def test_each_mode_implements_the_interface(strategy):
    """Every hook of ModeStrategy, with its parameters, and nothing set on the
    connector: the strategy is built from the pool and the requests alone."""
    for name, member in vars(ModeStrategy).items():
        if name.startswith("_") and name != "__init__" or not callable(member):
            continue
        want = list(inspect.signature(member).parameters)
        got = list(inspect.signature(getattr(strategy, name)).parameters)
        assert got == want, (strategy.__name__, name)
    assert strategy.layout in ("vllm-cpu", "hf") and strategy.holds
    built, _ = build(strategy, FakeSession())
    assert built.take_load_errors() == set() and built.worker_meta() is None
    built.close()


def test_load_mode_loads_the_leased_hit_beyond_vllms_own_blocks():
    """vLLM computed the first block itself: the lease covers both segments, the load
    skips that block, and the metadata carries the lease's grants."""
    session = FakeSession(hit=2 * C, locations=[SegmentLocation(0, 5), SegmentLocation(1, 7)])
    load, requests = build(LoadStrategy, session, salt="tenant")
    r = request("r", 2 * C + 3)
    assert requests.match(r, BLOCK) == 2 * C - BLOCK
    requests.allocated(r, blocks(10, 11, 12, 13, 14))
    load.allocated(r, 2 * C - BLOCK)
    assert session.calls == [("lease", "r", 2 * C, "tenant")]
    meta = load.build_meta(step({"r": 2 * C + 3}), {"r": 2 * C + 3})
    assert meta.loads == [Load("r", [(0, 5), (1, 7)], [[10, 11], [12, 13]], 1, ((0, b"grant-r"),))]
    assert meta.store is None and meta.failed_blocks == []  # nothing beyond the hit completes
    assert load.build_meta(step({}), {}).loads == []  # handed over once


def test_load_mode_stores_completed_segments_and_recomputes_a_lost_hit():
    session = FakeSession(hit=C, lease_error=PrefixNotCached("evicted"))
    load, requests = build(LoadStrategy, session)
    r = request("r", 3 * C + 1)
    requests.match(r, 0)
    requests.allocated(r, blocks(*range(20, 27)))
    load.allocated(r, C)  # the pool lost it since the match: vLLM computes its blocks
    meta = load.build_meta(step({"r": 2 * C}), {"r": 2 * C})
    assert meta.loads == [] and meta.failed_blocks == [20, 21]
    (_, (batch,), homes) = session.calls[-1]
    (planned,) = batch.requests
    assert homes == [0] and planned.new_token_ids == tuple(range(2 * C))
    assert meta.store.rows == [("r", [20, 21, 22, 23])]
    assert requests.pool_len["r"] == 2 * C and "r" in requests.admitted
    load.finished("r")
    requests.finished("r")
    assert session.calls[-1] == ("finish", "r") and not requests.admitted


def test_query_mode_plans_every_new_token_and_starts_over_when_preempted():
    session = FakeSession(hit=C, locations=[SegmentLocation(0, 3)])
    query, requests = build(QueryStrategy, session)
    r = request("r", C + 6)
    query.rematch("r")
    requests.match(r, 0)
    requests.allocated(r, blocks(30, 31, 32, 33))
    query.allocated(r, C)
    assert query.pooled_tokens == C and requests.pool_len["r"] == C
    meta = query.build_meta(step({"r": 5}), {"r": C + 5})
    (_, (batch,), _) = session.calls[-1]
    assert batch.phase == "prefill" and batch.requests[0].new_token_ids == tuple(range(C, C + 5))
    assert meta.query.anchors == {32: "r"} and meta.query.external == frozenset({"r"})
    assert requests.pool_len["r"] == C + 5
    # a step read in place that is not committed reports the block of each request's last
    # token before it: vLLM rolls back only to blocks below ceil(computed / block size)
    assert C % BLOCK == 0 and meta.query.last_block == {"r": 31}  # C - 1: block 1, the last one scanned
    meta = query.build_meta(step({"r": 1}), {"r": C + 6})  # a decode step, mid-block
    assert (C + 5) % BLOCK and meta.query.anchors == {33: "r"} and meta.query.last_block == {"r": 33}
    assert [30, 31, 32, 33].index(33) < -(-(C + 5) // BLOCK)
    query.rematch("r")  # preempted and scheduled again: released in the pool
    assert session.calls[-1] == ("finish", "r") and "r" not in requests.admitted


def test_query_mode_reports_a_step_the_pool_did_not_take():
    """The worker cannot reach the pool: the step's plans are aborted, the request whose
    prefix only the pool held is a load error (its first block), and the scheduler side
    releases it when told."""
    session = FakeSession(hit=C, locations=[SegmentLocation(0, 3)])
    query, requests = build(QueryStrategy, session)
    r = request("r", C + 5)
    requests.match(r, 0)
    requests.allocated(r, blocks(30, 31, 32, 33))
    query.allocated(r, C)
    meta = query.build_meta(step({"r": 5}), {"r": C + 5})
    worker, _ = build(QueryStrategy, session)  # the other process's object
    worker.start_load_kv(meta)
    batch = SimpleNamespace(query_start_loc=torch.tensor([0, 5]),
                            slot_mapping=torch.arange(32 * BLOCK, 32 * BLOCK + 5))
    assert worker.attend(0, None, None, None, batch, 1.0, meta) is None  # vLLM attends itself
    worker.wait_for_save(meta)
    assert session.calls[-1] == ("abort", meta.query.plans)
    assert worker.take_load_errors() == {30}
    report = worker.worker_meta()
    assert report == FailedRequests(frozenset({"r"})) and worker.worker_meta() is None
    query.step_output(SimpleNamespace(kv_connector_worker_meta=report))
    assert session.calls[-1] == ("finish", "r")
