"""``tokenlake bench e2e``: time to first token with a cached document versus
recomputing it, and decode speed through the pool versus the plain reference engine.

SmolLM2-135M on this machine's CPU, 4 instances, C = 256 (fewer, larger segments:
remote queries pay per segment, paper §4.2). Prints figures; asserts nothing.
"""

from __future__ import annotations

import time

from tokenlake.cluster import LocalCluster
from tokenlake.demo import _document
from tokenlake.serving import GenerationRequest, Server


def _long_document(tok, target_tokens: int) -> str:
    base = _document()
    parts, n = [], 0
    while n < target_tokens:
        part = f"Section {len(parts) + 1}.\n{base}"
        parts.append(part)
        n += len(tok.encode(part))
    return "\n\n".join(parts)


def bench_e2e(doc_tokens: int = 4096, decode_tokens: int = 32, chunk_tokens: int = 1024,
              instances: int = 4, segment_tokens: int = 256) -> dict:
    from tokenlake.llama.reference import ReferenceEngine
    from tokenlake.llama.tokenizer import load_tokenizer
    from tokenlake.llama.weights import load_weights

    weights, tok = load_weights(), load_tokenizer()
    spec = weights.config.to_model_spec("smollm2-135m")
    doc = _long_document(tok, doc_tokens)

    def prompt(question: str) -> tuple[int, ...]:
        return tuple(tok.apply_chat_template([{"role": "user", "content": f"{doc}\n\nQuestion: {question}"}]))

    seg = spec.num_layers * 2 * spec.num_kv_heads * segment_tokens * spec.head_dim * 4
    pool_bytes = (doc_tokens * 2 // segment_tokens // instances + 16) * seg
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
        t0 = time.perf_counter()
        server.run([GenerationRequest("decode", cached_prompt, decode_tokens + 1, ())])
        pool_s = time.perf_counter() - t0 - (first_token["decode"] - t0)
    ref = ReferenceEngine(weights)
    logits, cache = ref.prefill(list(cached_prompt))
    token = int(logits.argmax())
    t0 = time.perf_counter()
    for _ in range(decode_tokens):
        token = int(ref.decode_step(cache, token).argmax())
    ref_s = time.perf_counter() - t0
    return {
        "cached_ttft_ms": cached,
        "recompute_ttft_ms": recompute,
        "ttft_ratio": cached / recompute,
        "pool_decode_tok_s": decode_tokens / pool_s,
        "reference_decode_tok_s": decode_tokens / ref_s,
        "decode_ratio": (decode_tokens / pool_s) / (decode_tokens / ref_s),
        "prompt_tokens": len(cached_prompt),
        "cached_hit_tokens": hit,
        "setup": {"instances": instances, "segment_tokens": segment_tokens, "chunk_tokens": chunk_tokens,
                  "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to float32)", "decode_batch": 1},
    }
