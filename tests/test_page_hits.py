"""Prefix hits exact to a page (issue #19): a request whose prompt leaves a cached
segment part-way reuses the segment's matching leading pages, stores its own segment
(the shared pages copied into its open tail, then its own tokens), and a later request
that follows it past the divergence hits that segment. Outputs equal the reference.

The small Llama of tests/tiny_model.py serves (the claims are about matching and
storing pages; its reference answers are computed once and checked for clear margins),
in pools of the 17 segments 48 MiB held of SmolLM2."""

from __future__ import annotations

import pytest
from tiny_model import model_spec, pool_bytes
from token_util import common_prefix

from tokenlake.deploy.local import LocalCluster
from tokenlake.generation import GenerationLoop, GenerationRequest

C = 64
NEW = 4
SLOTS = 17  # segments per instance (what 48 MiB held of SmolLM2)


@pytest.fixture(scope="module")
def model(tiny_llama):
    """The tiny model, the shipped tokenizer and the tiny model's cached reference."""
    return tiny_llama


def _expected_hit(prompt, stored, page: int) -> int:
    """What a page-exact match finds: the common prefix with the stored whole segments,
    whole pages of it, at least one prompt token left to compute."""
    held = len(stored) // C * C
    n = min(common_prefix(prompt, stored[:held]), len(prompt) - 1)
    whole = n // C * C
    return whole + (n - whole) // page * page


@pytest.mark.parametrize("page", [16, 1])
def test_a_prompt_leaving_a_segment_part_way_reuses_its_pages(model, page):
    weights, tok, ref = model
    spec = model_spec(weights)
    doc = ("The river Lumen runs 212 kilometres from the Grey Hills to the sea at Kestrel "
           "Bay, past the mills of Orrin and the old stone bridge at Vell. ")
    first = tuple(tok.encode(doc * 6 + "How long is the river?"))
    assert len(first) > 3 * C
    # Leaves ``first`` inside a segment (not at a segment or page boundary).
    cut = 2 * C + 23
    second = first[:cut] + tuple(tok.encode(" Which town has the mills, and what is at Vell?" * 4))
    assert len(second) > 3 * C  # its own third segment fills
    # Follows ``second`` past its divergence, then leaves it too.
    third = second[: cut + 30] + tuple(tok.encode(" Answer with one word."))
    with LocalCluster(2, spec, pool_bytes(weights, C, SLOTS), segment_tokens=C, max_rows=512,
                      page_tokens=page) as cluster:
        server = GenerationLoop(cluster, weights, chunk_tokens=512, keep_logits=True)
        results = {}
        for rid, prompt in (("first", first), ("second", second), ("third", third)):
            results.update(server.run([GenerationRequest(rid, prompt, NEW, (tok.eos_id,))]))
            cluster.control.check()
        stats = cluster.control.stats()
    stored_first = list(first) + results["first"].output_ids[:-1]
    stored_second = list(second) + results["second"].output_ids[:-1]
    hit2 = _expected_hit(second, stored_first, page)
    hit3 = _expected_hit(third, stored_second, page)
    assert hit2 % C and hit2 > 2 * C  # whole segments plus pages of the next one
    assert results["second"].hit_tokens == hit2
    assert results["second"].prefill_tokens == len(second) - hit2
    # The third request matches the segment the second one stored past its divergence.
    assert hit3 > cut + 16 - page and results["third"].hit_tokens == hit3
    assert stats.hit_tokens == hit2 + hit3
    for rid, prompt in (("first", first), ("second", second), ("third", third)):
        expected = ref.generate(list(prompt), NEW, stop_ids=(tok.eos_id,))
        assert results[rid].output_ids == list(expected.output_ids), rid
        for got, want in zip(results[rid].logits, expected.logits):
            assert (got - want).abs().max().item() < 1e-4
