"""``ControlPlane.get_cache_load(reqs, ...)``: paper §6.1 with prefix lengths taken from
the global prefix tree."""

import pytest

from tokenlake.core.config import PoolConfig
from tokenlake.core.control import ControlPlane
from tokenlake.core.cost_model import LatencyModel, LoadRequest, get_cache_load
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.core.specs import load_hardware, load_model

C = 576


@pytest.fixture
def setup():
    model, hw = load_model("llama-2-7b"), load_hardware("a100-80gb")
    latency = LatencyModel.load("a100-80gb_llama-2-7b")
    cp = ControlPlane(PoolConfig(C, "llama", 64), model, range(4), clock=lambda: 0.0)
    return cp, model, hw, latency


def test_prefix_lengths_come_from_the_tree(setup):
    cp, model, hw, latency = setup
    doc = tuple(range(3, 3 + 8 * C))
    question = doc + tuple(range(40_000, 40_100))
    before = cp.get_cache_load([question], hw, latency)
    cp.complete(cp.gen_plans([Batch((BatchRequest("d", doc),))], [1]))
    after = cp.get_cache_load([question], hw, latency)
    # Cold: nothing cached, so no prefix attention and only the new KV is pool traffic.
    assert before == pytest.approx(get_cache_load([LoadRequest(len(question), 0)], 4, model, hw, latency))
    # Warm: the 8 cached segments are the prefix; the rest is input.
    warm = LoadRequest(input_len=len(question) - 8 * C, prefix_len=8 * C)
    assert after == pytest.approx(get_cache_load([warm], 4, model, hw, latency))
    assert 0.0 <= before < 1.0 and 0.0 < after < 1.0
    assert after != before


def test_a_fully_cached_prompt_leaves_one_token_to_compute(setup):
    cp, model, hw, latency = setup
    doc = tuple(range(3, 3 + 2 * C))
    cp.complete(cp.gen_plans([Batch((BatchRequest("d", doc),))], [1]))
    load = cp.get_cache_load([doc], hw, latency)
    expected = get_cache_load([LoadRequest(input_len=C, prefix_len=C)], 4, model, hw, latency)
    assert load == pytest.approx(expected)


def test_no_requests_no_load(setup):
    cp, _, hw, latency = setup
    assert cp.get_cache_load([], hw, latency) == 0.0
