"""``ControlPlane.get_cache_load(reqs, ...)``: paper §6.1 with prefix lengths taken from
the global prefix tree.

Expected loads are written out by hand here (not computed with ``get_cache_load``):
``M_r = sum 4d (prefix_len + input_len)`` bytes over all layers, ``F_r = sum
4 q_heads head_dim layers prefix_len input_len`` FLOPs, ``T_r`` from a latency model simple
enough to evaluate in a comment, ``L = max(M_r / (M_r + N B T_r), F_r / (F_r + N F T_r))``.
The cases include ones where the memory term wins the max (cold prompts, short inputs
over long prefixes) and one where the FLOP term wins.
"""

import pytest

from tokenlake.core.config import PoolConfig
from tokenlake.core.control import ControlPlane
from tokenlake.core.cost_model import LatencyModel
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.core.specs import load_hardware, load_model

C = 576
N = 4  # instances
#: Llama-2-7B: bytes of one token's K and V over its 32 layers in fp16 (the paper's 4d per
#: layer, d = 4096): 32 layers x 2 (K, V) x 32 kv heads x 128 x 2 bytes.
BYTES_PER_TOKEN = 32 * 2 * 32 * 128 * 2
#: FLOPs of one (query token, cached token) pair over the 32 layers: 4 x 32 heads x 128.
FLOPS_PER_PAIR = 32 * 4 * 32 * 128
#: ``T_r = 0.01 s + 1e-4 s x (new tokens) / N``: only the fixed and per-new-token terms.
LATENCY = LatencyModel(c_const=0.01, c_new=1e-4, c_new_prefix=0.0, c_new_sq=0.0,
                       c_prefix=0.0, c_request=0.0)


def by_hand(loads, hw):
    """``(memory share, FLOP share)`` of ``loads``, a list of (input_len, prefix_len)."""
    mem = sum(BYTES_PER_TOKEN * (prefix + new) for new, prefix in loads)
    flops = sum(FLOPS_PER_PAIR * prefix * new for new, prefix in loads)
    t = 0.01 + 1e-4 * sum(new for new, _ in loads) / N
    return mem / (mem + N * hw.mem_bw * t), flops / (flops + N * hw.flops * t)


@pytest.fixture
def setup():
    model, hw = load_model("llama-2-7b"), load_hardware("a100-80gb")
    assert model.kv_bytes_per_token == BYTES_PER_TOKEN  # the constants above are this model's
    cp = ControlPlane(PoolConfig(C, "llama", 64), model, range(N), clock=lambda: 0.0)
    return cp, hw


def store(cp, request_id, tokens):
    cp.complete(cp.gen_plans([Batch((BatchRequest(request_id, tokens),))], [1]))


def test_prefix_lengths_come_from_the_tree(setup):
    cp, hw = setup
    doc = tuple(range(3, 3 + 8 * C))
    question = doc + tuple(range(40_000, 40_100))
    before = cp.get_cache_load([question], hw, LATENCY)
    store(cp, "d", doc)
    after = cp.get_cache_load([question], hw, LATENCY)
    # Cold: nothing cached, so no prefix attention (no FLOP term) and the whole prompt is
    # new KV, all of it pool traffic: M_r = 4708 tokens x 512 KiB.
    mem, flops = by_hand([(len(question), 0)], hw)
    assert flops == 0.0 and before == pytest.approx(mem, rel=1e-12)
    # Warm: the 8 cached segments are the prefix and the 100 question tokens the input.
    # Memory wins (~2.4% against ~1.5%), and the input's 100 tokens are 2% of M_r.
    mem, flops = by_hand([(100, 8 * C)], hw)
    assert mem > flops
    assert after == pytest.approx(mem, rel=1e-12)
    assert 0.0 < before < after < 1.0


def test_memory_term_counts_the_new_tokens_of_a_decode_step(setup):
    """Decode (one new token over a long prefix) is memory-bound: ``L`` is the memory
    share, and each request's new token counts in ``M_r`` beside its prefix."""
    cp, hw = setup
    docs = [tuple(range(1000 * k, 1000 * k + 2 * C)) for k in range(1, 4)]
    for k, doc in enumerate(docs):
        store(cp, f"d{k}", doc)
    steps = [doc + (7,) for doc in docs]  # the cached document plus one decoded token
    mem, flops = by_hand([(1, 2 * C)] * 3, hw)
    assert mem > flops
    assert cp.get_cache_load(steps, hw, LATENCY) == pytest.approx(mem, rel=1e-12)
    # (Without the new tokens the memory term would be 1152/1153 of this, which
    # rel=1e-12 tells apart.)


def test_a_fully_cached_prompt_leaves_one_page_to_compute(setup):
    """The last page of a fully cached prompt is recomputed (the match stops one token
    short and keeps whole pages of 16): 16 inputs over a 1,136-token prefix. With whole
    segments only it would be 576 inputs over 576 tokens."""
    cp, hw = setup
    page = cp.config.page_tokens
    assert page == 16
    doc = tuple(range(3, 3 + 2 * C))
    store(cp, "d", doc)
    mem, flops = by_hand([(page, 2 * C - page)], hw)
    assert cp.get_cache_load([doc], hw, LATENCY) == pytest.approx(max(mem, flops), rel=1e-12)
    assert max(mem, flops) != pytest.approx(max(by_hand([(C, C)], hw)), rel=1e-6)


def test_no_requests_no_load(setup):
    cp, hw = setup
    assert cp.get_cache_load([], hw, LATENCY) == 0.0
