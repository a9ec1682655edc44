"""The query mode's worker side on one layer, without vLLM or a pool: vLLM's rows of a step
go to the plan's rows of the pool's buffers and back, in any order, and each row's answer
is attention over its pooled prefix and its new tokens (float64 reference).

A fake client stands for the pool instance: it holds each planned request's prefix K/V
and answers a query from the q rows written into its buffer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenlake.core.errors import EngineUnavailable, TokenLakeError
from tokenlake.core.plans import QueryItem
from tokenlake.engines.compute import COALESCE_PUT_ROWS
from tokenlake.kernels import attention as A
from tokenlake.kernels.attention import Partial

pytest.importorskip("vllm")
from tokenlake.integrations.vllm_query import QueryStrategy  # noqa: E402
from tokenlake.integrations.vllm_query_step import StepState  # noqa: E402

H, HK, E, LAYERS, BLOCK, SLOT = 6, 2, 8, 2, 16, 8


class FakePool:
    """``init_query``/``init_transfer``/``query_async``/``put`` of a pool instance whose
    plan rows are given by ``spans`` (request id -> (start, stop))."""

    def __init__(self, spans: dict[str, tuple[int, int]], prefix: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        rows = max(stop for _, stop in spans.values())
        self.spans, self.prefix = spans, prefix
        self.q = torch.full((rows, H, E), float("nan"))
        self.kv = torch.full((LAYERS, rows, 2, HK, E), float("nan"))
        self.puts: list = []
        self.fail_at: int | None = None  # a layer whose query fails
        self.queries = 0
        self.registered = ""

    def init_plans(self, query, transfer, wait=True):
        self.registered = "transfer" if query is None else "query and transfer"
        return (None if query is None else self.q), self.kv

    def put(self, layer, layers=1):
        self.puts.append((layer, layers))

    def wait_puts(self, timeout_s):
        self.puts.append("waited")

    def query_async(self, layer):
        self.queries += 1
        if layer == self.fail_at:
            def fail(timeout_s):
                raise EngineUnavailable("the query engine is gone (test)")
            return SimpleNamespace(wait=fail)
        o, lse = torch.zeros(self.q.shape), torch.zeros(self.q.shape[:2])
        for rid, (a, z) in self.spans.items():
            pk, pv = self.prefix[rid]
            for r in range(a, z):  # the pool attends a row over the request's prefix only
                ro, rl = A.partial_attention_ref(self.q[r:r + 1], pk, pv)
                o[r], lse[r] = ro[0].float(), rl[0].float()
        return SimpleNamespace(wait=lambda timeout_s: Partial(o, lse))


class FakeSlabs:
    """The pool instance's slab as the worker maps it (``SlabMaps.get``): each planned
    request's prefix in a slot of its own, the same K/V at every layer."""

    def __init__(self, prefix: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        self.slab = torch.zeros(len(prefix) + 1, LAYERS, 2, HK, SLOT, E)
        self.slots = {}
        for i, (rid, (pk, pv)) in enumerate(prefix.items()):
            self.slots[rid] = i + 1
            self.slab[i + 1, :, 0, :, :len(pk)] = pk.transpose(0, 1)
            self.slab[i + 1, :, 1, :, :len(pv)] = pv.transpose(0, 1)

    def get(self, instance):
        return self.slab

    def items(self, spans, prefix) -> dict:
        return {0: tuple(QueryItem(r, a, z, (self.slots[r],), (len(prefix[r][0]),))
                         for r, (a, z) in spans.items())}


def _step(spans: dict[str, tuple[int, int]], first_slot: dict[str, int], items=None) -> StepState:
    plan = SimpleNamespace(spans=[SimpleNamespace(request_id=r, start=a, stop=z) for r, (a, z) in spans.items()],
                           num_rows=max(z for _, z in spans.values()), tasks_by_instance=lambda: items)
    plans = SimpleNamespace(query_plans=(plan,), transfer_plans=(SimpleNamespace(),))
    anchors = {slot // BLOCK: rid for rid, slot in first_slot.items()}
    return SimpleNamespace(plans=plans, anchors=anchors, external=frozenset(), first_block={},
                           last_block={rid: 100 + slot // BLOCK for rid, slot in first_slot.items()})


@pytest.mark.parametrize("in_place", [False, True], ids=["by-engine", "in-place"])
@pytest.mark.parametrize("vllm_order,new", [(("a", "b"), 1), (("b", "a"), 1), (("b", "a"), 3),
                                              (("a", "b"), 17)])
def test_rows_go_to_the_plan_and_back_in_any_order(vllm_order, new, in_place):
    """Decode (1 new token each) and prompt chunks (3 and 17), vLLM's batch in the plan's
    order or reversed, layer after layer: the K/V and q rows land in the plan's rows, every
    row's output is attention over its prefix and its own new tokens, causally, and the
    K/V is put per layer (many rows) or all at once beside the last layer (a few). In
    place, the prefix is read from the mapped slab and nothing is asked of the query
    engine, which is not even told of the plan."""
    g = torch.Generator().manual_seed(new * 10 + len(vllm_order[0]))
    spans = {"a": (0, new), "b": (new, 2 * new)}
    prefix = {r: (torch.randn(5 + i, HK, E, generator=g), torch.randn(5 + i, HK, E, generator=g))
              for i, r in enumerate("ab")}
    pool = FakePool(spans, prefix)
    first_slot = {r: BLOCK * (3 + 2 * i) for i, r in enumerate(vllm_order)}  # a block each
    slabs = FakeSlabs(prefix) if in_place else None
    step = _step(spans, first_slot, slabs.items(spans, prefix) if in_place else None)
    state = StepState(step, pool, BLOCK, timeout_s=5.0, slabs=slabs)
    assert pool.registered == ("transfer" if in_place else "query and transfer")
    n = 2 * new
    meta = SimpleNamespace(query_start_loc=torch.tensor([0, new, n]),
                           slot_mapping=torch.tensor([first_slot[r] + j for r in vllm_order for j in range(new)]))
    few = n <= COALESCE_PUT_ROWS
    for layer in range(LAYERS):
        q, k, v = (torch.randn(n, h, E, generator=g) for h in (H, HK, HK))
        rows, out, complete = state.attend(layer, q, k, v, meta, E ** -0.5)
        assert complete and state.queried_rows == n * (layer + 1)
        got = torch.empty(n, H, E)
        got[rows] = out.reshape(-1, H, E)
        for j, rid in enumerate(vllm_order):
            a, z = spans[rid]
            mine = slice(j * new, (j + 1) * new)
            assert torch.equal(pool.kv[layer, a:z, 0], k[mine]) and torch.equal(pool.kv[layer, a:z, 1], v[mine])
            if not in_place:
                assert torch.equal(pool.q[a:z], q[mine])
            pk, pv = prefix[rid]
            want, _ = A.partial_attention_ref(q[mine], torch.cat([pk, k[mine]]), torch.cat([pv, v[mine]]),
                                              causal=True)
            assert torch.allclose(got[mine].double(), want, atol=1e-5)
        last = layer == LAYERS - 1
        assert pool.puts == ([(0, LAYERS)] if last else []) if few else [(i, 1) for i in range(layer + 1)]
        assert state.coalesced == (few and not last)
    state.finish()  # nothing left to put: only waited for
    assert pool.puts[-1] == "waited" and pool.puts.count("waited") == 1 and len(pool.puts) == (2 if few else 3)
    assert pool.queries == (0 if in_place else LAYERS)


def test_a_pass_cut_short_puts_its_layers_when_it_finishes():
    """Decode rows written for the first layer only (the pass stopped before the last):
    finish() puts every layer then, once."""
    spans = {"a": (0, 1)}
    pool = FakePool(spans, {"a": (torch.randn(4, HK, E), torch.randn(4, HK, E))})
    state = StepState(_step(spans, {"a": 0}), pool, BLOCK, timeout_s=5.0)
    meta = SimpleNamespace(query_start_loc=torch.tensor([0, 1]), slot_mapping=torch.tensor([0]))
    state.attend(0, torch.randn(1, H, E), torch.randn(1, HK, E), torch.randn(1, HK, E), meta, E ** -0.5)
    assert pool.puts == [] and state.coalesced
    state.finish()
    assert pool.puts == [(0, LAYERS), "waited"]


def test_a_step_whose_last_query_fails_waits_for_its_put_before_the_abort():
    """The step's one put is posted beside the last layer's query; when that query fails,
    the put is waited for before the plans are aborted (the abort frees its slots), and
    the step's requests are reported failed."""
    spans = {"a": (0, 1)}
    pool = FakePool(spans, {"a": (torch.randn(4, HK, E), torch.randn(4, HK, E))})
    pool.fail_at = LAYERS - 1
    cp = SimpleNamespace(timeout_s=5.0, abort=lambda plans: pool.puts.append("aborted"),
                         complete=lambda plans: pool.puts.append("completed"))
    strategy = QueryStrategy(SimpleNamespace(cp=cp, block_size=BLOCK, home=0), SimpleNamespace())
    step = _step(spans, {"a": 0})
    strategy._step = StepState(step, pool, BLOCK, timeout_s=5.0)
    meta = SimpleNamespace(query_start_loc=torch.tensor([0, 1]), slot_mapping=torch.tensor([0]))
    for layer in range(LAYERS):
        strategy._step.attend(layer, torch.randn(1, H, E), torch.randn(1, HK, E), torch.randn(1, HK, E),
                              meta, E ** -0.5)
    assert strategy._step.failed
    strategy.wait_for_save(SimpleNamespace(query=step))
    assert pool.puts == [(0, LAYERS), "waited", "aborted"]
    assert strategy.worker_meta().request_ids == frozenset({"a"})


@pytest.mark.parametrize("in_place", [False, True], ids=["by-engine", "in-place"])
def test_a_step_whose_commit_fails_discards_its_output_only_when_read_in_place(in_place):
    """A step whose commit fails (its plans were aborted meanwhile, e.g. the session
    was ended): the requests are reported failed either way. Read in place, nothing
    proves the slots held the plan's segments while they were read, so every request's
    block before the step is a load error too (vLLM drops the step's output and computes
    it again); through the engine, which checked each query's grant, the output stands."""
    spans = {"a": (0, 1)}
    prefix = {"a": (torch.randn(4, HK, E), torch.randn(4, HK, E))}
    pool = FakePool(spans, prefix)
    slabs = FakeSlabs(prefix) if in_place else None

    def refuse(plans):
        raise TokenLakeError("iteration 7 has no plans in flight")

    cp = SimpleNamespace(timeout_s=5.0, abort=lambda plans: pool.puts.append("aborted"), complete=refuse)
    strategy = QueryStrategy(SimpleNamespace(cp=cp, block_size=BLOCK, home=0), SimpleNamespace())
    step = _step(spans, {"a": 3 * BLOCK}, slabs.items(spans, prefix) if in_place else None)
    strategy._step = StepState(step, pool, BLOCK, timeout_s=5.0, slabs=slabs)
    meta = SimpleNamespace(query_start_loc=torch.tensor([0, 1]), slot_mapping=torch.tensor([3 * BLOCK]))
    for layer in range(LAYERS):
        assert strategy._step.attend(layer, torch.randn(1, H, E), torch.randn(1, HK, E), torch.randn(1, HK, E),
                                     meta, E ** -0.5) is not None
    strategy.wait_for_save(SimpleNamespace(query=step))
    assert pool.puts[-1] == "aborted"
    assert strategy.worker_meta().request_ids == frozenset({"a"})
    assert strategy.take_load_errors() == ({step.last_block["a"]} if in_place else set())


def test_a_step_that_read_nothing_in_place_keeps_the_engines_rule():
    """An in-place step whose registration failed read no slot: only the requests whose
    prefix only the pool held are computed again (none here), not every request."""
    spans = {"a": (0, 1)}
    prefix = {"a": (torch.randn(4, HK, E), torch.randn(4, HK, E))}
    pool, slabs = FakePool(spans, prefix), FakeSlabs(prefix)

    def refuse(query, transfer, wait=True):
        raise EngineUnavailable("the transfer engine is gone (test)")

    pool.init_plans = refuse
    cp = SimpleNamespace(timeout_s=5.0, abort=lambda plans: pool.puts.append("aborted"),
                         complete=lambda plans: pool.puts.append("completed"))
    strategy = QueryStrategy(SimpleNamespace(cp=cp, block_size=BLOCK, home=0), SimpleNamespace())
    step = _step(spans, {"a": 3 * BLOCK}, slabs.items(spans, prefix))
    strategy._step = StepState(step, pool, BLOCK, timeout_s=5.0, slabs=slabs)
    meta = SimpleNamespace(query_start_loc=torch.tensor([0, 1]), slot_mapping=torch.tensor([3 * BLOCK]))
    assert strategy._step.attend(0, torch.randn(1, H, E), torch.randn(1, HK, E), torch.randn(1, HK, E),
                                 meta, E ** -0.5) is None  # vLLM attends itself
    strategy.wait_for_save(SimpleNamespace(query=step))
    assert pool.puts[-1] == "aborted" and strategy.take_load_errors() == set()
    assert strategy.worker_meta().request_ids == frozenset({"a"})
