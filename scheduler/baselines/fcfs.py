"""First-come-first-served with chunked prefill: the serving loop's simplest policy.

Every decode request runs in one decode batch on one instance; each prefill request
(the running ones first, then the waiting ones in arrival order) gets a batch of its
own on ``prefill_dop`` instances (1 by default; fewer when fewer are free) and computes
at most ``chunk_tokens`` of its prompt, while free instances last. No latency model, no
SLO: the baseline the goodput DP improves on, and a fixed DoP for measuring sequence
parallelism (``tokenlake bench e2e``).
"""

from __future__ import annotations

from scheduler.api import BatchDecision, Decision, Snapshot


class FCFS:
    name = "fcfs"

    def __init__(self, chunk_tokens: int = 512, prefill_dop: int = 1) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if prefill_dop < 1:
            raise ValueError(f"prefill_dop must be >= 1, got {prefill_dop}")
        self.chunk_tokens = chunk_tokens
        self.prefill_dop = prefill_dop

    def schedule(self, snap: Snapshot) -> Decision:
        free = snap.free_instances
        batches: list[BatchDecision] = []
        decode = tuple(r.request_id for r in snap.running if r.phase == "decode")
        if decode and free:
            batches.append(BatchDecision(decode, "decode", 1, (1,) * len(decode)))
        prefill = [r for r in snap.running if r.phase == "prefill"]
        prefill += sorted(snap.waiting, key=lambda r: r.arrival_s)
        free -= len(batches)
        for r in prefill:
            if free < 1:
                break
            n = min(r.remaining_prefill, self.chunk_tokens)
            dop = min(self.prefill_dop, free, n)
            batches.append(BatchDecision((r.request_id,), "prefill", dop, (n,)))
            free -= dop
        return Decision(tuple(batches))
