"""FlowKV-style load-aware routing.

Idea from the FlowKV paper (Li et al., "FlowKV: A Disaggregated Inference Framework with
Low-Latency KV Cache Transfer and Load-Aware Scheduling", Alibaba Cloud, 2025, §3.4 and
App. B): normalise each node's load metrics and route to the node with the lowest
weighted "comprehensive load score". FlowKV tunes its weights
experimentally and does not publish them; we use three of its metrics with these weights:

    score_i = W_PREFILL * queued_prefill_tokens_i / max_j(queued_prefill_tokens_j)
            + W_DECODE  * running_decodes_i       / max_j(running_decodes_j)
            + W_KV      * kv_used_i / kv_capacity_i

with W_PREFILL = 0.5, W_DECODE = 0.3, W_KV = 0.2 (a max of 0 normalises to 0). Ties go
to the first instance in order. The request's own prefill tokens are added to the queue
of the chosen instance when it is routed.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

W_PREFILL, W_DECODE, W_KV = 0.5, 0.3, 0.2


@dataclass
class InstanceLoad:
    queued_prefill_tokens: int = 0
    running_decodes: int = 0
    kv_used: int = 0
    kv_capacity: int = 1


class FlowKVRouter:
    def __init__(
        self,
        instances: Sequence[Hashable],
        kv_capacity: int = 1,
        weights: tuple[float, float, float] = (W_PREFILL, W_DECODE, W_KV),
    ) -> None:
        if not instances or kv_capacity <= 0 or min(weights) < 0:
            raise ValueError("need instances, positive kv_capacity, non-negative weights")
        self.instances = list(instances)
        self.weights = weights
        self.load = {i: InstanceLoad(kv_capacity=kv_capacity) for i in self.instances}

    def scores(self) -> dict[Hashable, float]:
        wp, wd, wk = self.weights
        max_p = max(s.queued_prefill_tokens for s in self.load.values())
        max_d = max(s.running_decodes for s in self.load.values())
        return {
            i: wp * (s.queued_prefill_tokens / max_p if max_p else 0.0)
            + wd * (s.running_decodes / max_d if max_d else 0.0)
            + wk * s.kv_used / s.kv_capacity
            for i, s in self.load.items()
        }

    def choose(self) -> Hashable:
        scores = self.scores()
        return min(self.instances, key=lambda i: scores[i])

    def route(self, prefill_tokens: int) -> Hashable:
        inst = self.choose()
        self.load[inst].queued_prefill_tokens += prefill_tokens
        return inst

    # Observations the serving loop feeds back.
    def prefill_done(self, inst: Hashable, tokens: int) -> None:
        s = self.load[inst]
        s.queued_prefill_tokens -= tokens
        s.running_decodes += 1
        s.kv_used += tokens

    def decode_done(self, inst: Hashable, kv_tokens: int) -> None:
        s = self.load[inst]
        s.running_decodes -= 1
        s.kv_used -= kv_tokens

    def set_load(self, inst: Hashable, **fields: int) -> None:
        for k, v in fields.items():
            setattr(self.load[inst], k, v)
