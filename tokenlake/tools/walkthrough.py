"""Control-plane walk-through: a LooGLE-like workload on the pool, with and without
heavy-hitter replication (``tokenlake walkthrough``).

Only metadata moves here: every plan is "executed" at once by calling
:meth:`ControlPlane.complete`, and replications finish at once. What it shows is what
the control plane decides: hit rate, deduplication, per-instance cache reads and their
coefficient of variation (CV) over time.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

from tokenlake.core.config import PoolConfig
from tokenlake.core.control import ControlPlane
from tokenlake.core.placement import coefficient_of_variation
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.core.specs import ModelSpec, load_model


@dataclass(frozen=True)
class WorkloadConfig:
    """A LooGLE-like workload: shared documents, many questions each, Zipf popularity.

    Token counts are in tokens; ``zipf_s`` skews which document a question is about.
    """

    num_documents: int = 40
    document_tokens: int = 24_000
    system_prompt_tokens: int = 1_200
    questions_per_document: tuple[int, int] = (6, 25)
    question_tokens: int = 40
    output_tokens: int = 16
    num_requests: int = 400
    concurrency: int = 16
    zipf_s: float = 1.1
    seed: int = 0


@dataclass(frozen=True)
class WalkthroughResult:
    """What one run measured."""

    replication: bool
    requests: int
    hit_rate: float  # reused prefix tokens / input tokens
    dedup_bytes: int
    reads: dict[int, int]  # cumulative segment reads per instance
    cv_over_time: list[float] = field(default_factory=list)  # CV of reads per 1 s bucket
    replications: int = 0
    segments: int = 0

    @property
    def mean_cv(self) -> float:
        """Mean CV over time, skipping the first quarter (warm-up)."""
        tail = self.cv_over_time[len(self.cv_over_time) // 4 :]
        return statistics.fmean(tail) if tail else 0.0

    def to_dict(self) -> dict:
        """The JSON form ``tokenlake walkthrough --json`` prints (bytes in bytes)."""
        return {
            "replication": self.replication,
            "requests": self.requests,
            "hit_rate": self.hit_rate,
            "cv": self.mean_cv,
            "segments": self.segments,
            "replications": self.replications,
            "dedup_bytes": self.dedup_bytes,
            "reads_per_instance": {str(k): v for k, v in self.reads.items()},
        }


def _make_prompts(w: WorkloadConfig, rng: random.Random, vocab: int) -> list[list[tuple[int, ...]]]:
    system = tuple(rng.randrange(3, vocab) for _ in range(w.system_prompt_tokens))
    docs = []
    for _ in range(w.num_documents):
        doc = system + tuple(rng.randrange(3, vocab) for _ in range(w.document_tokens))
        n_q = rng.randint(*w.questions_per_document)
        docs.append(
            [doc + tuple(rng.randrange(3, vocab) for _ in range(w.question_tokens)) for _ in range(n_q)]
        )
    return docs


def run(
    n_instances: int = 8,
    replication: bool = True,
    workload: WorkloadConfig = WorkloadConfig(),
    model: ModelSpec | None = None,
    segment_tokens: int = 576,
    slots_per_instance: int = 400,
    step_s: float = 0.05,
) -> WalkthroughResult:
    """Serves the workload through the control plane and measures balance and hits."""
    model = model or load_model("llama-2-7b")
    rng = random.Random(workload.seed)
    now = [0.0]
    config = PoolConfig(segment_tokens, f"{model.name}/walkthrough", slots_per_instance, seed=workload.seed)
    cp = ControlPlane(config, model, list(range(n_instances)), clock=lambda: now[0])
    docs = _make_prompts(workload, rng, model.vocab_size)
    weights = [1.0 / (i + 1) ** workload.zipf_s for i in range(len(docs))]
    queue = [rng.choice(docs[rng.choices(range(len(docs)), weights)[0]]) for _ in range(workload.num_requests)]
    queue.reverse()
    running: dict[str, int] = {}  # request id -> output tokens left
    cvs: list[float] = []
    last_reads = {i: 0 for i in range(n_instances)}
    bucket, next_id = 0, 0
    while queue or running:
        batches = []
        decode = [BatchRequest(rid, (rng.randrange(3, model.vocab_size),)) for rid in running]
        if decode:
            batches.append(Batch(tuple(decode), "decode"))
        while queue and len(running) < workload.concurrency and len(batches) < n_instances:
            prompt = queue.pop()
            hit = cp.get_prefix_tree().match(prompt, max_tokens=len(prompt) - 1).hit_tokens
            rid = f"r{next_id}"
            next_id += 1
            batches.append(Batch((BatchRequest(rid, prompt[hit:], prompt[:hit]),), "prefill"))
            running[rid] = workload.output_tokens + 1
        plans = cp.gen_plans(batches, [1] * len(batches))
        cp.complete(plans)
        for rid in list(running):
            running[rid] -= 1
            if running[rid] == 0:
                del running[rid]
                cp.finish_request(rid)
        now[0] += step_s
        if replication:
            for rep in cp.rebalance():
                cp.finish_replication(rep)
        if int(now[0]) > bucket:
            bucket = int(now[0])
            reads = cp.stats().pool.reads
            delta = [reads[i] - last_reads[i] for i in range(n_instances)]
            last_reads = dict(reads)
            if sum(delta):
                cvs.append(coefficient_of_variation(delta))
    stats = cp.stats()
    return WalkthroughResult(
        replication, next_id, stats.hit_rate, stats.dedup_bytes, dict(stats.pool.reads), cvs,
        stats.pool.replications, stats.pool.segments,
    )


def print_report(results: list[WalkthroughResult], workload: WorkloadConfig, n_instances: int,
                 segment_tokens: int = 576) -> None:
    """Prints the runs of ``tokenlake walkthrough`` side by side for a reader."""
    print(f"Control-plane walk-through: {workload.num_requests} LooGLE-like requests "
          f"({workload.num_documents} shared documents of {workload.document_tokens} tokens, "
          f"Zipf {workload.zipf_s}) on {n_instances} instances, C = {segment_tokens} tokens\n")
    for r in results:
        title = "with heavy-hitter replication" if r.replication else "hash placement only"
        print(f"[{title}]")
        print(f"  hit rate            {r.hit_rate:6.1%}   (reused prefix tokens / input tokens)")
        print(f"  segments in pool    {r.segments:6d}   replicas made: {r.replications}")
        print(f"  deduplicated        {r.dedup_bytes / 2**30:6.2f} GiB")
        print(f"  cache-access CV     {r.mean_cv:6.1%}   (mean over time of per-instance reads)")
        total = sum(r.reads.values()) or 1
        print("  reads per instance  " + " ".join(f"{100 * v / total:4.1f}%" for v in r.reads.values()))
        print()
