"""Pool query equals monolithic attention for other head layouts (random prompts)."""

import random

import dataplane_util as du
import pytest

from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.core.specs import ModelSpec
from tokenlake.deploy.local import LocalCluster

SHAPES = [
    ModelSpec(name="smollm-like", num_layers=1, hidden_size=576, num_q_heads=9, num_kv_heads=3, head_dim=64,
              intermediate_size=1536, vocab_size=1000, num_params=1e6, dtype_bytes=4, max_context=4096),
    ModelSpec(name="mha", num_layers=3, hidden_size=64, num_q_heads=2, num_kv_heads=2, head_dim=32,
              intermediate_size=128, vocab_size=1000, num_params=1e5, dtype_bytes=4, max_context=4096),
]


@pytest.mark.parametrize("model", SHAPES, ids=lambda m: m.name)
def test_random_prompts_match_the_reference(model):
    c, n = 16, 3
    seg = model.num_layers * 2 * model.num_kv_heads * c * model.head_dim * 4
    rng = random.Random(model.num_q_heads)
    with LocalCluster(n, model, 40 * seg, segment_tokens=c, max_rows=256) as cluster:
        cp = cluster.control
        shared = [rng.randrange(3, 900) for _ in range(2 * c)]
        tokens = {f"p{i}": shared + [rng.randrange(3, 900) for _ in range(rng.randrange(1, 3 * c))] for i in range(4)}
        for step in range(3):
            batches = []
            for rid, toks in tokens.items():
                if rid in cp.live_requests:
                    start = cp.prefix_tokens(rid)
                    new = tuple(toks[start : start + 1]) if start < len(toks) else (rng.randrange(3, 900),)
                    if start >= len(toks):
                        toks.append(new[0])
                    batches.append(BatchRequest(rid, new))
                else:
                    hit = cp.get_prefix_tree().match(toks, max_tokens=len(toks) - 1).hit_tokens
                    batches.append(BatchRequest(rid, tuple(toks[hit:]), tuple(toks[:hit])))
            groups = [Batch(tuple(batches[i::n])) for i in range(n) if batches[i::n]]
            plans = cp.gen_plans(groups, [1] * len(groups))
            new_counts = {r.request_id: len(r.new_token_ids) for r in batches}
            results = du.execute(cluster, plans, tokens, new_counts, model)
            cp.complete(plans)
            for (rid, _pos, layer), (q, o, lse, span) in results.items():
                if span.prefix_tokens == 0:
                    continue
                ro, rlse = du.reference_prefix(tokens[rid], span.prefix_tokens, q, layer, model)
                assert (o.double() - ro).abs().max() < 1e-5, (step, rid)
                assert (lse.double() - rlse).abs().max() < 1e-5
                if span.position == span.prefix_tokens:
                    eo, el = du.full_attention_check(tokens[rid], span, q, o, lse, layer, model)
                    assert eo < 1e-5 and el < 1e-5
        assert any(len(p) > 1 for p in [{t.instance for t in qp.tasks} for qp in plans.query_plans])
        for rid in list(cp.live_requests):
            cp.finish_request(rid)
