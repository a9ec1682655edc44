"""``tokenlake bench e2e``: time to first token with a cached document versus
recomputing it, and decode speed through the pool versus the plain reference engine.

SmolLM2-135M on this machine's CPU, 4 instances. The segment size C is the paper's
threshold rule (§4.2) applied to the measured ``cpu`` hardware profile (1,088 tokens):
below it a remote segment query costs more in messaging than it saves in compute, which
on a CPU with zmq messaging (~90 us per hop) is a much larger C than on NVLink GPUs.
Decode is measured at several batch sizes, the reference engine batched the same way.
Prints figures; asserts nothing.
"""

from __future__ import annotations

import time

from tokenlake.core.cost_model import default_segment_tokens
from tokenlake.core.specs import load_hardware
from tokenlake.deploy.local import LocalCluster
from tokenlake.model.llama.reference import ReferenceEngine
from tokenlake.model.llama.tokenizer import load_tokenizer
from tokenlake.model.llama.weights import load_weights
from tokenlake.serving import GenerationRequest, Server
from tokenlake.tools.demo import _document


def _long_document(tok, target_tokens: int) -> str:
    base = _document()
    parts, n = [], 0
    while n < target_tokens:
        part = f"Section {len(parts) + 1}.\n{base}"
        parts.append(part)
        n += len(tok.encode(part))
    return "\n\n".join(parts)


def _pool_decode(server: Server, prompts: list[tuple[int, ...]], steps: int, tag: str) -> float:
    """Decode tokens/s of ``len(prompts)`` requests decoding together, timed from the
    iteration after every request has its first token."""
    reqs = [GenerationRequest(f"{tag}{i}", p, steps + 1, ()) for i, p in enumerate(prompts)]
    for r in reqs:
        server.submit(r)
    while any(not server.results[r.request_id].output_ids for r in reqs):
        server.step()
    t0 = time.perf_counter()
    while any(not server.results[r.request_id].done for r in reqs):
        server.step()
    return len(reqs) * steps / (time.perf_counter() - t0)


def _reference_decode(ref, prompts: list[tuple[int, ...]], steps: int) -> float:
    """The same for the monolithic engine, batched the same way (one weight pass per step)."""
    caches, tokens = [], []
    for p in prompts:
        logits, cache = ref.prefill(list(p))
        caches.append(cache)
        tokens.append(int(logits.argmax()))
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens = ref.decode_batch(caches, tokens).argmax(dim=1).tolist()
    return len(prompts) * steps / (time.perf_counter() - t0)


def bench_e2e(doc_tokens: int = 4096, decode_tokens: int = 32, chunk_tokens: int = 1024,
              instances: int = 4, segment_tokens: int | None = None, decode_batches: tuple[int, ...] = (1, 8)) -> dict:

    weights, tok = load_weights(), load_tokenizer()
    spec = weights.config.to_model_spec("smollm2-135m")
    if segment_tokens is None:
        segment_tokens = default_segment_tokens(spec, load_hardware("cpu"))
    doc = _long_document(tok, doc_tokens)

    def prompt(question: str) -> tuple[int, ...]:
        return tuple(tok.apply_chat_template([{"role": "user", "content": f"{doc}\n\nQuestion: {question}"}]))

    seg = spec.num_layers * 2 * spec.num_kv_heads * segment_tokens * spec.head_dim * 4
    pool_bytes = (doc_tokens * 2 // segment_tokens // instances + 2 * max(decode_batches) + 16) * seg
    first_token: dict[str, float] = {}
    with LocalCluster(instances, spec, pool_bytes, segment_tokens=segment_tokens, max_rows=chunk_tokens) as cluster:
        server = Server(cluster, weights, chunk_tokens=chunk_tokens,
                        on_token=lambda rid, _t: first_token.setdefault(rid, time.perf_counter()))

        def ttft(rid: str, p: tuple[int, ...], max_new: int = 1) -> float:
            t0 = time.perf_counter()
            server.run([GenerationRequest(rid, p, max_new, ())])
            return (first_token[rid] - t0) * 1e3

        recompute = ttft("cold", prompt("How tall is the Harbor Lighthouse?"))
        cached_prompt = prompt("Who was the first keeper of the lighthouse?")
        cached = ttft("warm", cached_prompt)
        hit = server.results["warm"].hit_tokens
        questions = [prompt(f"What does section {i + 1} say about the keeper?") for i in range(max(decode_batches))]
        pool = {b: _pool_decode(server, questions[:b], decode_tokens, f"d{b}-") for b in decode_batches}
    ref = ReferenceEngine(weights)
    reference = {b: _reference_decode(ref, questions[:b], decode_tokens) for b in decode_batches}
    main = decode_batches[0]
    return {
        "cached_ttft_ms": cached,
        "recompute_ttft_ms": recompute,
        "ttft_ratio": cached / recompute,
        "pool_decode_tok_s": pool[main],
        "reference_decode_tok_s": reference[main],
        "decode_ratio": pool[main] / reference[main],
        "decode_by_batch": {str(b): {"pool_tok_s": pool[b], "reference_tok_s": reference[b],
                                     "ratio": pool[b] / reference[b]} for b in decode_batches},
        "prompt_tokens": len(cached_prompt),
        "cached_hit_tokens": hit,
        "setup": {"instances": instances, "segment_tokens": segment_tokens, "chunk_tokens": chunk_tokens,
                  "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to float32)", "decode_batch": main,
                  "decode_tokens": decode_tokens},
    }
