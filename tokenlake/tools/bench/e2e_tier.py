"""``tokenlake bench e2e``'s ``tier`` row: time to first token of a question about a
document held only in the tier, against recomputing it.

One instance of SmolLM2-135M whose slab holds one document and a little more, with a
disk tier in a temporary directory (or, ``medium="memory"``, a tier in the transfer
engine's host memory: then nothing is written to disk and no page cache is dropped). Each round takes a document of its own: a first
question about it is computed from scratch (the recompute figure; its segments are
written through to the tier), two more documents of the same size push it out of the
slab (every segment of it is then held only in the tier: the row says how many), the tier files are dropped from the operating system's page cache
(``posix_fadvise(DONTNEED)``, so the read comes from the disk, not from memory), and a
second question about the first document is answered from the tier: its segments
promoted, its own tokens computed. Medians and ranges of both, and their ratio. The
first round's tier answer is checked against the reference engine's (greedy,
``check_tokens`` tokens).

The tier question's promotion is overlapped with its own iteration (its layers read in
while the first ones are attended). With ``serial`` each round also pushes the document
out again and asks a second question of the same length with every read in the
background (the request waiting for its whole read: the way before the overlap), the
two orders alternating from round to round: ``serial_tier_ttft_ms`` and the ratio
``overlap_vs_serial``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tokenlake.core.cost_model import default_segment_tokens
from tokenlake.core.specs import load_hardware
from tokenlake.deploy.config import ClusterConfig
from tokenlake.deploy.local import LocalCluster
from tokenlake.engines.tier_files import SUFFIX
from tokenlake.generation import GenerationLoop, GenerationRequest
from tokenlake.kernels.native import machine_info
from tokenlake.model.llama.reference import ReferenceEngine


def drop_page_cache(directory: Path) -> int:
    """Asks the kernel to drop the cached pages of every tier file under ``directory``
    (they are written and flushed: clean pages go); returns the files."""
    n = 0
    for path in directory.rglob(f"*{SUFFIX}"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        n += 1
    return n


def _wait_written(cluster, directory: Path, timeout_s: float = 120.0) -> None:
    """The tier writes in the background: waits until every copy the control plane
    counts is a file (the measured read must come from the disk)."""
    want = sum(cluster.control.stats().pool.tier.held.values())
    deadline = time.monotonic() + timeout_s
    while len(list(directory.rglob(f"*{SUFFIX}"))) < want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the tier wrote fewer than {want} files in {timeout_s:.0f} s")
        time.sleep(0.05)


def bench_tier(weights, tok, document, doc_tokens: int = 4096, rounds: int = 2,
               chunk_tokens: int = 1024, check_tokens: int = 8, segment_tokens: int | None = None,
               kv_dtype: str = "float32", medium: str = "disk", serial: bool = False) -> dict:
    """The tier row (see the module docstring). ``document(tok, n, tag)``: a text of about
    ``n`` tokens, different for each ``tag``."""
    spec = weights.config.to_model_spec("smollm2-135m")
    if segment_tokens is None:
        segment_tokens = default_segment_tokens(spec, load_hardware("cpu"))
    seg = spec.num_layers * 2 * spec.num_kv_heads * segment_tokens * spec.head_dim * getattr(torch, kv_dtype).itemsize
    doc_segments = -(-doc_tokens // segment_tokens) + 1
    first_token: dict[str, float] = {}
    recompute, tiered, hits, promoted, held, serial_ms = [], [], [], [], [], []
    equal = None
    with tempfile.TemporaryDirectory(prefix="tokenlake-tier-") as tmp:
        config = ClusterConfig(1, spec, (doc_segments + 2) * seg, segment_tokens=segment_tokens,
                               max_rows=chunk_tokens, kv_dtype=kv_dtype,
                               tier_path=tmp if medium == "disk" else None,
                               tier_bytes=(rounds + 1) * 2 * doc_segments * seg)
        with LocalCluster(config) as cluster:
            server = GenerationLoop(cluster, weights, chunk_tokens=chunk_tokens,
                                    on_token=lambda rid, _t: first_token.setdefault(rid, time.perf_counter()))

            def ttft(rid: str, prompt: tuple[int, ...], max_new: int = 1) -> float:
                t0 = time.perf_counter()
                server.run([GenerationRequest(rid, prompt, max_new, ())])
                return (first_token[rid] - t0) * 1e3

            def push_out(r: int, tags: str) -> None:
                for other in tags:  # the document leaves the slab (and the page cache)
                    ttft(f"push{other}{r}", _ask(tok, document(tok, doc_tokens, f"{other}{r}"), "Who built it?"))
                if medium == "disk":
                    _wait_written(cluster, Path(tmp))
                    drop_page_cache(Path(tmp))

            for r in range(rounds):
                doc = document(tok, doc_tokens, f"A{r}")
                recompute.append(ttft(f"cold{r}", _ask(tok, doc, "How tall is the Harbor Lighthouse?")))
                for overlap in ((True, False) if r % 2 == 0 else (False, True)) if serial else (True,):
                    push_out(r, "BC" if overlap else "DE")
                    server.tier_reads.layered = overlap
                    if not overlap:  # another question: the first one's own segments are cached now
                        serial_ms.append(ttft(f"serial{r}", _ask(tok, doc, "Who was the last keeper of the lighthouse?")))
                        continue
                    before = server.promotions
                    question = _ask(tok, doc, "Who was the first keeper of the lighthouse?")
                    m = cluster.control.get_prefix_tree().match(question, max_tokens=len(question) - 1)
                    held.append({"in_slab": len(m.keys), "only_in_tier": len(m.tier_keys)})
                    tiered.append(ttft(f"tier{r}", question, check_tokens if r == 0 else 1))
                    hits.append(server.results[f"tier{r}"].hit_tokens)
                    promoted.append(server.promotions - before)
                if r == 0:
                    want = ReferenceEngine(weights, getattr(torch, kv_dtype)).generate(
                        list(question), check_tokens)
                    equal = server.results["tier0"].output_ids == list(want.output_ids)
            tier_stats = cluster.control.stats().pool.tier
    return {**_times(recompute, tiered, serial_ms), "rounds": rounds, "prompt_tokens": len(question),
            "hit_tokens": hits, "promoted_segments": promoted, "segments_before_the_question": held,
            "answer_equal_to_reference": equal,
            "checked_tokens": check_tokens, "demotions": tier_stats.demotions,
            "setup": {"instances": 1, "segment_tokens": segment_tokens, "slab_segments": doc_segments + 2,
                      "kv_dtype": kv_dtype, "medium": medium,
                      "page_cache": "dropped before each tier read (posix_fadvise)" if medium == "disk" else None},
            "machine": machine_info()}


def _ask(tok, text: str, question: str) -> tuple[int, ...]:
    return tuple(tok.apply_chat_template([{"role": "user", "content": f"{text}\n\nQuestion: {question}"}]))


def _times(recompute: list[float], tiered: list[float], serial_ms: list[float]) -> dict:
    """The row's times: medians, ranges and ratios (the serial ones where measured)."""
    med_r, med_t = statistics.median(recompute), statistics.median(tiered)
    paired = {} if not serial_ms else {
        "serial_tier_ttft_ms": statistics.median(serial_ms), "serial_tier_range_ms": [min(serial_ms), max(serial_ms)],
        "overlap_vs_serial": med_t / statistics.median(serial_ms),
        "overlap_vs_serial_per_round": [t / s for t, s in zip(tiered, serial_ms)]}
    return {**paired, "tier_ttft_ms": med_t, "tier_range_ms": [min(tiered), max(tiered)],
            "recompute_ttft_ms": med_r, "recompute_range_ms": [min(recompute), max(recompute)],
            "ttft_ratio": med_t / med_r}


def tier_row(doc_tokens: int = 4096, rounds: int = 2, chunk_tokens: int = 1024,
             kv_dtype: str = "float32", medium: str = "disk", serial: bool = False) -> dict:
    """:func:`bench_tier` on the shipped SmolLM2 and the e2e benchmark's documents."""
    from tokenlake.model.llama.tokenizer import load_tokenizer
    from tokenlake.model.llama.weights import load_weights
    from tokenlake.tools.bench.e2e import tagged_document

    return bench_tier(load_weights(), load_tokenizer(), tagged_document, doc_tokens, rounds,
                      chunk_tokens, kv_dtype=kv_dtype, medium=medium, serial=serial)


def summary(row: dict) -> str:
    where = "the disk tier" if row["setup"].get("medium", "disk") == "disk" else "host memory"
    return (f"TTFT from {where} {row['tier_ttft_ms']:.0f} ms ({row['tier_range_ms'][0]:.0f}-"
            f"{row['tier_range_ms'][1]:.0f}) vs recompute {row['recompute_ttft_ms']:.0f} ms "
            f"({row['recompute_range_ms'][0]:.0f}-{row['recompute_range_ms'][1]:.0f}): "
            f"{row['ttft_ratio']:.2f}x; answer equal to the reference: {row['answer_equal_to_reference']}"
            + (f"; overlapped read {row['overlap_vs_serial']:.2f}x the whole read first "
               f"({row['serial_tier_ttft_ms']:.0f} ms)" if "overlap_vs_serial" in row else ""))
