"""The model where its weights are (issue #45): ``LlamaWeights.placed(device, dtype)``
puts the matrices in half on a GPU, and the compute engine and the reference engine run
where the weights are. The CPU checks the dtype handling (half matrices on the CPU: the
pool's answers equal the reference's with the same weights, to the KV dtype's tolerance);
the tests marked ``gpu`` run the same comparison with the model and the pool on a GPU
(``pytest -m gpu``; skipped without one)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import pytest
import torch
from test_kv_dtype import _agrees
from test_serving import NEW, C, _prompts, serve_two_waves
from tiny_model import model_spec, pool_bytes

import tokenlake
from tokenlake.deploy.local import LocalCluster
from tokenlake.generation import GenerationLoop
from tokenlake.model.llama.reference import LOGIT_TOLERANCE, ReferenceEngine

SLOTS = 34
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_placed_weights_keep_their_norms_in_float32(tiny_llama):
    weights = tiny_llama[0]
    half = weights.placed("cpu", "bfloat16")
    assert half.dtype == half.layers[0].wq.dtype == half.layers[-1].w_down.dtype == torch.bfloat16
    assert half.final_norm.dtype == half.layers[0].attn_norm.dtype == torch.float32
    assert weights.placed("cpu", torch.float32) is weights and weights.dtype == torch.float32
    assert weights.for_pool("cpu", "bfloat16") is weights  # a CPU pool's model stays float32
    assert half.nbytes() < 0.6 * weights.nbytes()
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        weights.placed("cpu", torch.int8)


def test_half_matrices_move_the_logits_a_little_and_not_the_answer(tiny_llama):
    """The reference with bfloat16 matrices against float32 on the same prompt: logits
    close, the same greedy token at every step (a wrong ``placed`` or half product, which
    the pool-against-reference tests share with the reference, fails here)."""
    weights, tok, _ = tiny_llama
    prompt = _prompts(tok)[0]
    f32 = ReferenceEngine(weights).generate(list(prompt), 4, stop_ids=())
    half = ReferenceEngine(weights.placed("cpu", torch.bfloat16)).generate(list(prompt), 4, stop_ids=())
    assert half.output_ids == f32.output_ids
    for a, b in zip(half.logits, f32.logits):
        assert 0 < (a - b).abs().max().item() < 0.05 * b.abs().max().item()


def _through_the_pool(weights, tok, device: str, kv_dtype: str, instances: int = 2):
    prompts = _prompts(tok)
    with LocalCluster(instances, model_spec(weights), pool_bytes(weights, C, SLOTS), segment_tokens=C,
                      max_rows=512, kv_dtype=kv_dtype, device=device) as cluster:
        results = serve_two_waves(cluster, weights, tok, prompts)
    ref = ReferenceEngine(weights, getattr(torch, kv_dtype))
    for i, prompt in enumerate(prompts):
        res = results[f"p{i}"]
        want = ref.generate(list(prompt), NEW, stop_ids=(tok.eos_id,))
        assert all(row.device.type == "cpu" for row in want.logits + list(res.logits))
        _agrees(res.output_ids, res.logits, want, LOGIT_TOLERANCE[kv_dtype])
    assert results["p1"].hit_tokens > 0
    return results


def test_half_matrices_generate_through_the_pool_what_the_reference_generates(tiny_llama):
    """bfloat16 matrices on the CPU: the compute engine's rows go through the same
    rounding as the reference's, so the answers agree to the bfloat16 tolerance."""
    weights, tok, _ = tiny_llama
    _through_the_pool(weights.placed("cpu", torch.bfloat16), tok, "cpu", "bfloat16")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_the_model_on_the_gpu_generates_what_the_gpu_reference_generates(request, which):
    """The paper's set-up on one GPU: the compute engine (this process), two instances'
    query and transfer engines, the model's weights, activations and the pool's buffers
    all on the GPU in bfloat16; answers equal the reference engine's on the GPU in the
    same dtype, to its near ties."""
    weights, tok, _ = request.getfixturevalue("tiny_llama" if which == "tiny" else "smollm2")
    placed = weights.placed("cuda", torch.bfloat16)
    assert placed.device.type == "cuda"
    _through_the_pool(placed, tok, "cuda", "bfloat16")


@pytest.mark.gpu
@cuda
def test_the_reference_on_the_gpu_stays_close_to_the_float32_cpu_one(tiny_llama):
    weights, tok, _ = tiny_llama
    ids = _prompts(tok)[0]
    gpu, _ = ReferenceEngine(weights.placed("cuda", torch.bfloat16), torch.bfloat16).prefill(ids)
    cpu, _ = ReferenceEngine(weights).prefill(ids)
    assert gpu.device.type == "cpu" and (gpu - cpu).abs().max().item() < 1.0
    assert gpu.argmax() == cpu.argmax()


@pytest.mark.gpu
@cuda
def test_serve_on_the_gpu_answers_the_openai_client_as_the_gpu_reference(smollm2):
    """``tokenlake serve --device cuda``: the model and two instances on the GPU behind the
    OpenAI API. Two questions about one shared document (the second's prefix is served
    by the pool) get, through the official client, the greedy text of the reference
    engine on the GPU with the same bfloat16 weights, up to a near tie."""
    import openai
    from service_util import terminate
    from test_serve_command import START_TIMEOUT_S, _lines, _next_event

    from tokenlake.tools.demo import _document, _near_tie

    weights, tok, _ = smollm2
    doc = _document()
    questions = ["How tall is the Harbor Lighthouse?", "Who was the first keeper of the lighthouse?"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"{doc}\n\nQuestion: {q}"}]) for q in questions]
    ref = ReferenceEngine(weights.placed("cuda", torch.bfloat16), torch.bfloat16)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenlake.tools.cli", "serve", "--device", "cuda", "--kv-dtype", "bfloat16",
         "--instances", "2", "--pool-mb", "64", "--control-port", "0", "--http-port", "0", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("TOKENLAKE_")},
             "TOKENLAKE_HOME": os.environ["TOKENLAKE_HOME"]})
    try:
        events = _lines(proc)
        assert _next_event(events, START_TIMEOUT_S)["event"] == "starting"
        ready = _next_event(events, START_TIMEOUT_S)
        assert ready["event"] == "ready", ready
        with openai.OpenAI(base_url=ready["http_url"] + "/v1", api_key="unused", max_retries=0,
                           timeout=120) as client:
            for ids in prompts:
                got = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=16,
                                                temperature=0, extra_body={"ignore_eos": True})
                want = ref.generate(ids, 16, stop_ids=())
                text = tok.decode(want.output_ids, skip_special_tokens=True)  # as the API's text
                if got.choices[0].text != text:  # only where the reference nearly tied
                    assert _near_tie(want, tok.encode(got.choices[0].text), "bfloat16"), (got.choices[0].text, text)
        with tokenlake.connect(ready["address"]) as cp:
            assert cp.stats().hit_rate > 0, "the second question's document came from the pool"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        terminate(proc, 60)  # after a failed check: it still cleans up
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("device, medium", [
    ("cpu", "memory"),
    pytest.param("cuda", "disk", marks=(pytest.mark.gpu, cuda)),
    pytest.param("cuda", "memory", marks=(pytest.mark.gpu, cuda))])
def test_a_half_model_reads_a_document_back_from_the_tier(tiny_llama, tmp_path, device, medium):
    """A tier below the slabs (host memory or a disk), on the GPU too: the document
    pushed out of the slabs comes back into them from the tier, and the answers are the
    reference's with the same bfloat16 weights on the same device."""
    from test_tier import _ask, _config, _other

    weights, tok, _ = tiny_llama
    placed = weights.placed(device, torch.bfloat16)
    f32 = _config(weights, tmp_path, medium=medium)  # half K/V: as many segments in half the bytes
    config = dataclasses.replace(f32, pool_bytes=f32.pool_bytes // 2, kv_dtype="bfloat16", device=device)
    with LocalCluster(config) as cluster:
        server = GenerationLoop(cluster, placed, chunk_tokens=64, keep_logits=True)
        doc = _prompts(tok)[0]
        first = _ask(server, "a", doc, tok)
        _ask(server, "b", _other(tok), tok)  # its segments take the slab: the document's are demoted
        m = cluster.control.get_prefix_tree().match(doc, max_tokens=len(doc) - 1)
        assert m.tier_keys, "the document is held only in the tier"
        again = _ask(server, "a2", doc, tok)
        assert server.promotions >= len(m.tier_keys) and again.hit_tokens >= len(m.tier_keys) * C
        cluster.control.check()
    want = ReferenceEngine(placed, torch.bfloat16).generate(list(doc), NEW, stop_ids=(tok.eos_id,))
    for got in (first, again):
        _agrees(got.output_ids, got.logits, want, LOGIT_TOLERANCE["bfloat16"])
