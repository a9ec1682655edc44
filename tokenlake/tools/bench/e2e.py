"""``tokenlake bench e2e``: time to first token with a cached document versus
recomputing it, and decode speed through the pool versus the plain reference engine.

SmolLM2-135M on this machine's CPU, 4 instances. The segment size C is the paper's
threshold rule (§4.2) applied to the measured ``cpu`` hardware profile (1,088 tokens):
below it a remote segment query costs more in messaging than it saves in compute, which
on a CPU with zmq messaging (~90 us per hop) is a much larger C than on NVLink GPUs.
Decode is measured at several batch sizes, the reference engine batched the same way,
pool and reference alternately (``decode_rounds`` rounds, medians and ranges; the
reference engine's caches prefilled once and decoding on from round to round).
``dop_ttft`` is the time to first token of a cold prompt prefilled with a fixed degree
of parallelism (``FCFS(prefill_dop=k)``) on one compute engine per instance
(:class:`~tokenlake.engines.compute.ParallelComputeEngine`): every DoP once per round, the
order reversed every other round, medians and ranges, and each DoP's speed-up over the
first DoP given.
``--kv-dtype`` runs the pool (and the plain engine's cache) in bfloat16 or float16;
``--no-share-slabs`` sends the remote shares of queries by message instead of reading
the co-located slabs (docs/data-plane.md "Co-located slabs").
``vllm``: afterwards, vLLM's CPU build on the same prompts and cores
(:mod:`tokenlake.tools.bench.vllm_side`), as the row a user would compare against.
The command adds the ``tier`` row afterwards: a question about a document held only in
the disk tier against recomputing it (:mod:`tokenlake.tools.bench.e2e_tier`).
Prints figures; asserts nothing.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from scheduler.baselines.fcfs import FCFS
from tokenlake.core.cost_model import default_segment_tokens
from tokenlake.core.specs import load_hardware
from tokenlake.deploy.gpu import gpu_setup
from tokenlake.deploy.local import LocalCluster
from tokenlake.engines.compute import ParallelComputeEngine
from tokenlake.generation import GenerationLoop, GenerationRequest
from tokenlake.kernels import native
from tokenlake.kernels.native import machine_info
from tokenlake.model.llama.reference import ReferenceEngine
from tokenlake.model.llama.tokenizer import load_tokenizer
from tokenlake.model.llama.weights import load_weights
from tokenlake.tools.demo import _document


def _long_document(tok, target_tokens: int) -> str:
    base = _document()
    parts, n = [], 0
    while n < target_tokens:
        part = f"Section {len(parts) + 1}.\n{base}"
        parts.append(part)
        n += len(tok.encode(part))
    return "\n\n".join(parts)


def tagged_document(tok, target_tokens: int, tag: str) -> str:
    """A document of about ``target_tokens`` tokens that shares no prefix with another
    ``tag``'s."""
    return f"Record {tag}.\n{_long_document(tok, target_tokens)}"


def _pool_decode(server: GenerationLoop, prompts: list[tuple[int, ...]], steps: int, tag: str,
                 layer_s: list[float] | None = None) -> float:
    """Decode tokens/s of ``len(prompts)`` requests decoding together, timed from the
    iteration after every request has its first token (``layer_s``, the list the engine's
    ``on_query`` appends to, is emptied there: it then holds the decode steps' alone)."""
    reqs = [GenerationRequest(f"{tag}{i}", p, steps + 1, ()) for i, p in enumerate(prompts)]
    for r in reqs:
        server.submit(r)
    while any(not server.results[r.request_id].output_ids for r in reqs):
        server.step()
    if layer_s is not None:
        layer_s.clear()
    t0 = time.perf_counter()
    while any(not server.results[r.request_id].done for r in reqs):
        server.step()
    return len(reqs) * steps / (time.perf_counter() - t0)


def _reference_decode(ref, caches: list, tokens: list[int], steps: int) -> float:
    """The same for the monolithic engine over prefilled ``caches`` (which grow by
    ``steps`` tokens: a later round goes on from there), batched the same way (one
    weight pass per step); ``tokens`` are updated in place."""
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens[:] = ref.decode_batch(caches, tokens).argmax(dim=1).tolist()
    return len(caches) * steps / (time.perf_counter() - t0)


def _decode_rounds(server, ref, questions, batches, steps: int, rounds: int) -> dict[int, dict[str, list[float]]]:
    """Decode tokens/s of the pool and of the reference engine, alternately: every round
    measures each batch size on both, the order of the two reversed every other round."""
    caches, tokens = [], []
    for p in questions[: max(batches)]:  # the reference's prefills, once (the pool's hit its cache)
        logits, cache = ref.prefill(list(p))
        caches.append(cache)
        tokens.append(int(logits.argmax()))
    out = {b: {"pool": [], "reference": [], "layer_ms": []} for b in batches}
    layer_s: list[float] = []  # each layer's pool query: sent to answered (ComputeEngine.on_query)
    server.engine.on_query = layer_s.append
    for r in range(rounds):
        for b in batches:
            for who in (("pool", "reference") if r % 2 == 0 else ("reference", "pool")):
                if who == "pool":
                    out[b][who].append(_pool_decode(server, questions[:b], steps, f"d{b}-{r}-", layer_s))
                    out[b]["layer_ms"] += [t * 1e3 for t in layer_s]
                    continue
                head = tokens[:b]
                out[b][who].append(_reference_decode(ref, caches[:b], head, steps))
                tokens[:b] = head
    return out


def dop_ttft(cluster, weights, prompts: dict[int, list[tuple[int, ...]]], chunk_tokens: int) -> dict:
    """Cold TTFT (ms) of ``prompts[dop][round]`` at each fixed prefill DoP, rounds
    interleaved (every DoP once per round) so that drift on a shared machine hits all."""
    engine = ParallelComputeEngine(weights, cluster)
    times: dict[int, list[float]] = {d: [] for d in prompts}
    try:
        for r in range(len(next(iter(prompts.values())))):
            for dop in (list(prompts) if r % 2 == 0 else list(prompts)[::-1]):
                first: dict[str, float] = {}
                server = GenerationLoop(cluster, weights, chunk_tokens=chunk_tokens, engine=engine,
                                policy=FCFS(chunk_tokens, prefill_dop=dop), rebalance_every=0,
                                on_token=lambda rid, _t, first=first: first.setdefault(rid, time.perf_counter()))
                t0 = time.perf_counter()
                server.run([GenerationRequest(f"dop{dop}-{r}", prompts[dop][r], 1, ())])
                assert all(b.dop == min(dop, cluster.n_instances) for d in server.decisions for b in d.batches)
                times[dop].append((first[f"dop{dop}-{r}"] - t0) * 1e3)
    finally:
        engine.close()
    base = statistics.median(next(iter(times.values())))
    return {str(d): {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t),
                     "speedup_vs_first": base / statistics.median(t)} for d, t in times.items()}


def bench_e2e(doc_tokens: int = 4096, decode_tokens: int = 32, chunk_tokens: int = 1024,
              instances: int = 4, segment_tokens: int | None = None, decode_batches: tuple[int, ...] = (1, 8),
              dops: tuple[int, ...] = (1, 2, 4), dop_tokens: int = 2048, rounds: int = 3,
              kv_dtype: str = "float32", vllm: bool = False, decode_rounds: int = 2,
              share_slabs: bool = True, device: str = "cpu", bf16_products: int = 0) -> dict:
    weights, tok, gpu = _model(device, kv_dtype)
    spec = weights.config.to_model_spec("smollm2-135m")
    if segment_tokens is None:
        segment_tokens = default_segment_tokens(spec, load_hardware(_hardware_name(gpu)))
    doc = _long_document(tok, doc_tokens)

    def prompt(question: str) -> tuple[int, ...]:
        return tuple(tok.apply_chat_template([{"role": "user", "content": f"{doc}\n\nQuestion: {question}"}]))

    seg = spec.segment_bytes(segment_tokens) * getattr(torch, kv_dtype).itemsize // spec.dtype_bytes
    pool_bytes = (doc_tokens * 2 // segment_tokens // instances + 2 * max(decode_batches) + 16) * seg
    first_token: dict[str, float] = {}
    with LocalCluster(instances, spec, pool_bytes, segment_tokens=segment_tokens, max_rows=chunk_tokens,
                      kv_dtype=kv_dtype, share_slabs=share_slabs, device=device, bf16_products=bf16_products) as cluster:
        server = GenerationLoop(cluster, weights, chunk_tokens=chunk_tokens,
                        on_token=lambda rid, _t: first_token.setdefault(rid, time.perf_counter()))

        def ttft(rid: str, p: tuple[int, ...], max_new: int = 1) -> float:
            t0 = time.perf_counter()
            server.run([GenerationRequest(rid, p, max_new, ())])
            return (first_token[rid] - t0) * 1e3

        _warm_up(server, tok, chunk_tokens)
        cold_prompt = prompt("How tall is the Harbor Lighthouse?")
        recompute = ttft("cold", cold_prompt)
        cached_prompt = prompt("Who was the first keeper of the lighthouse?")
        cached = ttft("warm", cached_prompt)
        hit = server.results["warm"].hit_tokens
        questions = [prompt(f"What does section {i + 1} say about the keeper?") for i in range(max(decode_batches))]
        ref = ReferenceEngine(weights, getattr(torch, kv_dtype))
        runs = _decode_rounds(server, ref, questions, decode_batches, decode_tokens, decode_rounds)
        cold = _long_document(tok, dop_tokens)
        by_dop = {d: [tuple(tok.encode(f"Run {d}.{r}. {cold}")) for r in range(rounds)] for d in dops}
        parallel = dop_ttft(cluster, weights, by_dop, chunk_tokens) if dops else {}
    pool, reference, by_batch = _decode_summary(runs, decode_rounds)
    main = decode_batches[0]
    side = None
    if vllm:
        from tokenlake.tools.bench.vllm_side import vllm_side_by_side

        side = vllm_side_by_side(weights, tok, cold_prompt, cached_prompt, questions, decode_batches,
                                 decode_tokens, lambda line: print(line, file=sys.stderr, flush=True))
    return {
        "vllm": side,
        "cached_ttft_ms": cached,
        "recompute_ttft_ms": recompute,
        "ttft_ratio": cached / recompute,
        "pool_decode_tok_s": pool[main],
        "reference_decode_tok_s": reference[main],
        "decode_ratio": pool[main] / reference[main],
        "decode_by_batch": by_batch,
        "prompt_tokens": len(cached_prompt),
        "dop_ttft": parallel,
        "dop_prompt_tokens": len(by_dop[dops[0]][0]) if dops else 0,
        "cached_hit_tokens": hit,
        "setup": {"instances": instances, "segment_tokens": segment_tokens, "chunk_tokens": chunk_tokens,
                  "kv_dtype": kv_dtype, "share_slabs": share_slabs and gpu is None, **_where(device, gpu, kv_dtype),
                  "decode_batch": main, "decode_tokens": decode_tokens},
        "machine": machine_info(), "row_ops": native.row_ops(torch.ones(1)) is not None,  # TOKENLAKE_ROW_OPS
    }


def _warm_up(server: GenerationLoop, tok, chunk_tokens: int) -> None:
    """An untimed request first, of a whole chunk and a part (a prefix of its own): a
    GPU's first kernels of each shape (and every engine's first query) load and plan
    what later ones reuse, so the timed runs are steady state."""
    prompt = tuple(tok.encode(f"Warm up. {_long_document(tok, chunk_tokens + 64)}"))
    server.run([GenerationRequest("warm-up", prompt, 4, ())])


def _model(device: str, kv_dtype: str):
    """``(weights, tokenizer, GPU name or None)``: on a GPU ``device`` the weights are
    placed there, their matrices in the pool's ``kv_dtype``."""
    gpu = None if device == "cpu" else torch.cuda.get_device_name(device)
    return load_weights().for_pool(device, kv_dtype), load_tokenizer(), gpu


def _where(device: str, gpu: str | None, kv_dtype: str) -> dict:
    """The setup's model and device fields (a GPU's: its name and :func:`gpu_setup`)."""
    model = "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to float32)"
    if gpu is None:
        return {"model": model, "device": device}
    return {"model": f"{model}, matrices in {kv_dtype}", "device": device, "gpu": gpu, "gpu_setup": gpu_setup()}


def _hardware_name(gpu: str | None) -> str:
    """The hardware profile (``tokenlake/data/hardware.json``) that sizes the default
    segment for ``gpu`` (its CUDA name; ``None``: the CPU; a GPU without a profile of its
    own: the H100's)."""
    if gpu is None:
        return "cpu"
    name = gpu.lower()
    return "h200" if "h200" in name else "a100-80gb" if "a100" in name else "h100-80gb"


def _decode_summary(runs: dict, rounds: int) -> tuple[dict, dict, dict]:
    """Medians of the pool and the reference per batch size, and the JSON rows. Besides the
    ratio of the medians, each round's own ratio (its pool run against the reference run
    beside it: drift between rounds, which this machine has, cancels) and their median."""
    pool = {b: statistics.median(r["pool"]) for b, r in runs.items()}
    reference = {b: statistics.median(r["reference"]) for b, r in runs.items()}
    paired = {b: [p / q for p, q in zip(r["pool"], r["reference"])] for b, r in runs.items()}
    rows = {str(b): {"pool_tok_s": pool[b], "reference_tok_s": reference[b], "ratio": pool[b] / reference[b],
                     "ratio_by_round": paired[b], "ratio_paired": statistics.median(paired[b]),
                     "layer_query_ms": statistics.median(r["layer_ms"]) if r["layer_ms"] else None,
                     "pool_range": [min(r["pool"]), max(r["pool"])],
                     "reference_range": [min(r["reference"]), max(r["reference"])], "rounds": rounds}
            for b, r in runs.items()}
    return pool, reference, rows


def summary(result: dict) -> str:
    """The human-readable lines of a :func:`bench_e2e` result."""
    lines = [f"TTFT cached {result['cached_ttft_ms']:.0f} ms vs recompute "
             f"{result['recompute_ttft_ms']:.0f} ms; decode {result['pool_decode_tok_s']:.1f} tok/s "
             f"(pool) vs {result['reference_decode_tok_s']:.1f} (reference)"]
    for b, row in result["decode_by_batch"].items():
        rounds = ", ".join(f"{x:.2f}" for x in row.get("ratio_by_round", ()))
        lines.append(f"decode, {b} request(s): {row['ratio']:.2f}x the reference (medians); by round {rounds}")
    side = result.get("vllm")
    if side:
        batches = ", ".join(f"{b}: {row['pool_tok_s']:.1f} vs {side['decode_tok_s'][b]:.1f}"
                            for b, row in result["decode_by_batch"].items())
        lines.append(f"vLLM (CPU build, same prompts and cores): TTFT cold {side['cold_ttft_ms']:.0f} ms, "
                     f"cached {side['cached_ttft_ms']:.0f} ms; decode tok/s by batch, pool vs vLLM: {batches}")
    first = next(iter(result["dop_ttft"]), None)
    for dop, row in result["dop_ttft"].items():
        lines.append(f"cold TTFT at DoP {dop}: {row['median_ms']:.0f} ms ({row['min_ms']:.0f}-"
                     f"{row['max_ms']:.0f}), {row['speedup_vs_first']:.2f}x DoP {first}")
    return "\n".join(lines)
