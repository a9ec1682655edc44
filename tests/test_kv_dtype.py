"""Pools that hold their K/V in bfloat16 or float16 (issue #21): the slab's dtype and
size, the namespace, the reference engine's cache of the same dtype, and a model
generating through a half-precision pool what the reference generates with a cache of
that dtype. The data-plane paths (puts, queries, replication, migration, page copies)
run in half-precision pools in tests/test_dataplane.py.

Generation runs the small Llama of tests/tiny_model.py (reference answers computed once
per run and checked for clear margins); what rounding the cache does to SmolLM2's logits
is still measured on SmolLM2."""

from __future__ import annotations

import pytest
import torch
from dataplane_util import TINY
from test_serving import NEW, C, _prompts, serve_two_waves
from tiny_model import model_spec, pool_bytes, reference

from tokenlake.core.control import KV_DTYPES
from tokenlake.core.errors import ConfigError
from tokenlake.deploy.local import LocalCluster
from tokenlake.generation import GenerationRequest
from tokenlake.model.llama.reference import LOGIT_TOLERANCE, GenerationResult, ReferenceEngine
from tokenlake.tools.demo import _near_tie

SEGMENT_F32 = TINY.num_layers * 2 * TINY.num_kv_heads * C * TINY.head_dim * 4
SLOTS_24M = 34  # float32 segments per instance of 24 MiB of SmolLM2 (twice as many in half)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_a_half_pool_holds_twice_the_segments_in_its_dtype(kv_dtype):
    pool_bytes = 10 * SEGMENT_F32
    with LocalCluster(1, TINY, pool_bytes, segment_tokens=C, max_rows=32, kv_dtype=kv_dtype) as half, \
            LocalCluster(1, TINY, pool_bytes, segment_tokens=C, max_rows=32) as full:
        assert full.slots_per_instance == 10 and half.slots_per_instance == 20
        assert half.slab(0).dtype == getattr(torch, kv_dtype) and full.slab(0).dtype == torch.float32
        assert half.slab(0).nbytes == full.slab(0).nbytes
        # the compute engine writes its new K/V in the pool's dtype; q and partials stay float32
        client = half.client(0)
        assert client.kv.dtype == getattr(torch, kv_dtype)
        assert client.q.dtype == client.out_o.dtype == client.out_lse.dtype == torch.float32
        short = KV_DTYPES[kv_dtype][1]
        assert f"/{short}/" in half.control.config.namespace
        assert half.control.config.namespace != full.control.config.namespace


def test_an_unknown_kv_dtype_is_refused():
    with pytest.raises(ConfigError, match="kv_dtype"):
        LocalCluster(1, TINY, SEGMENT_F32, segment_tokens=C, kv_dtype="int8")


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_the_reference_cache_holds_the_dtype_and_attends_in_float32(smollm2, kv_dtype):
    weights, tok, ref32 = smollm2
    ref = ReferenceEngine(weights, kv_dtype)
    ids = tok.encode("The river Lumen runs 212 kilometres to the sea.")
    logits, cache = ref.prefill(ids)
    assert cache.keys[0].dtype == kv_dtype and cache.length == len(ids)
    want, _ = ref32.prefill(ids)
    assert logits.dtype == torch.float32
    # rounding the cache moves the logits, but not by much
    assert 0 < (logits - want).abs().max().item() < 1.0


def _agrees(got_ids, got_logits, want: GenerationResult, tolerance: float) -> None:
    """Token for token until a near tie of the reference (a margin of at most twice the
    tolerance; then the rest may differ); logits within ``tolerance`` on every step both
    took the same way."""
    for step, (a, b) in enumerate(zip(got_ids, want.output_ids)):
        diff = (got_logits[step] - want.logits[step]).abs().max().item()
        assert diff < tolerance, (step, diff)
        if a != b:
            margin = (want.logits[step][b] - want.logits[step][a]).item()
            assert margin <= 2 * tolerance, (step, margin)
            return
    assert got_ids == list(want.output_ids)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_generation_through_a_half_pool_equals_the_reference_of_that_dtype(tiny_llama, kv_dtype):
    weights, tok, _ = tiny_llama
    ref = reference(weights, getattr(torch, kv_dtype))
    prompts = _prompts(tok)
    with LocalCluster(2, model_spec(weights), pool_bytes(weights, C, SLOTS_24M), segment_tokens=C,
                      max_rows=512, kv_dtype=kv_dtype) as cluster:
        results = serve_two_waves(cluster, weights, tok, prompts)
    for i, prompt in enumerate(prompts):
        res = results[f"p{i}"]
        _agrees(res.output_ids, res.logits, ref.generate(list(prompt), NEW, stop_ids=(tok.eos_id,)),
                LOGIT_TOLERANCE[kv_dtype])
    assert results["p1"].hit_tokens > 0


def test_the_demo_names_a_near_tie_and_nothing_else():
    """A half pool's answer may leave the reference's where the reference's two best
    logits lie within the dtype's tolerance; any other difference is one."""
    logits = [torch.tensor([0.0, 5.0, 4.6]), torch.tensor([3.0, 0.0, 2.4])]
    run = GenerationResult([1, 0], logits, False)
    tie = _near_tie(run, [2, 0], "bfloat16")  # margin 0.4 <= 2 x 0.25
    assert tie["step"] == 0 and tie["margin"] == pytest.approx(0.4, abs=1e-5)
    assert _near_tie(run, [1, 2], "bfloat16") is None  # margin 0.6: a real difference
    assert _near_tie(run, [2, 0], "float32") is None  # float32 is held to equality
    assert _near_tie(run, [1, 0], "bfloat16") is None  # equal outputs


def test_the_reference_baseline_holds_the_kv_dtype_it_is_served_with(tiny_llama):
    """``tokenlake serve --engine reference --kv-dtype bfloat16``: the baseline's caches
    are in the pool's dtype, and it generates what the reference engine of that dtype
    generates (chunked prefill included)."""
    from tokenlake.generation.reference import ReferenceLoop
    from tokenlake.service.serve import reference_service

    weights, tok, _ = tiny_llama
    with reference_service((weights, tok), http_port=0, kv_dtype="bfloat16") as served:
        assert served.http.loop.server.engine.kv_dtype == torch.bfloat16
    server = ReferenceLoop(weights, chunk_tokens=24, kv_dtype=torch.bfloat16)
    prompt = tuple(_prompts(tok)[0])
    result = server.submit(GenerationRequest("r", prompt, 4, (tok.eos_id,)))
    server.step()
    assert server._live["r"].cache.keys[0].dtype == torch.bfloat16
    while server.busy:
        server.step()
    want = reference(weights, torch.bfloat16).generate(list(prompt), 4, stop_ids=(tok.eos_id,))
    assert result.output_ids == list(want.output_ids)
