"""Cache-centric PD disaggregation, as SGLang + Mooncake xPyD (the paper's "MoonCake").

``P`` prefill instances each keep a local prefix cache (a radix tree of token ids with
per-instance LRU eviction); ``D`` decode instances only decode. Flow of one request:

1. :meth:`prefill` sends it to the prefill instance with the longest *local* cached prefix;
   on a miss (no instance holds any of it) or a tie, the least-loaded of the candidates by
   in-flight prefills (then instance order). The prompt then enters that instance's cache.
2. :meth:`complete_prefill` picks the decode instance with the fewest in-flight decodes
   and records a :class:`KVTransfer` of the whole prompt's KV from P to D
   (``bytes = tokens * kv_bytes_per_token``).
3. :meth:`finish` ends the decode.

``XPyDRouter.split(instances, "1P3D", ...)`` makes the first x instances prefill and the
other y decode; 1P3D and 3P1D are the paper's two configurations.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from .radix import RadixTree


@dataclass(frozen=True)
class KVTransfer:
    request_id: Hashable
    src: Hashable  # prefill instance
    dst: Hashable  # decode instance
    tokens: int
    bytes: int


class XPyDRouter:
    def __init__(
        self,
        prefill_instances: Sequence[Hashable],
        decode_instances: Sequence[Hashable],
        kv_bytes_per_token: int,
        cache_capacity_tokens: int | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not prefill_instances or not decode_instances:
            raise ValueError("need at least one prefill and one decode instance")
        if set(prefill_instances) & set(decode_instances):
            raise ValueError("an instance cannot be both prefill and decode")
        if kv_bytes_per_token <= 0:
            raise ValueError("kv_bytes_per_token must be > 0")
        self.prefill_instances = list(prefill_instances)
        self.decode_instances = list(decode_instances)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.cache_capacity_tokens = cache_capacity_tokens
        counter = itertools.count(1)
        self.clock = clock or (lambda: float(next(counter)))
        self.cache = RadixTree()  # one tree, one tenant per prefill instance = local caches
        for p in self.prefill_instances:
            self.cache.add_tenant(p)
        self.prefill_load: dict[Hashable, int] = dict.fromkeys(self.prefill_instances, 0)
        self.decode_load: dict[Hashable, int] = dict.fromkeys(self.decode_instances, 0)
        self.transfers: list[KVTransfer] = []
        self._prefilling: dict[Hashable, tuple[Hashable, int]] = {}
        self._decoding: dict[Hashable, Hashable] = {}

    @classmethod
    def split(cls, instances: Sequence[Hashable], config: str, kv_bytes_per_token: int,
              **kwargs) -> XPyDRouter:
        m = re.fullmatch(r"(\d+)P(\d+)D", config)
        if m is None:
            raise ValueError(f"config must look like '1P3D', got {config!r}")
        x, y = int(m.group(1)), int(m.group(2))
        if x + y != len(instances):
            raise ValueError(f"{config} needs {x + y} instances, got {len(instances)}")
        return cls(instances[:x], instances[x:], kv_bytes_per_token, **kwargs)

    @property
    def roles(self) -> dict[Hashable, str]:
        return {**dict.fromkeys(self.prefill_instances, "prefill"),
                **dict.fromkeys(self.decode_instances, "decode")}

    def local_hit(self, token_ids: Sequence[int], instance: Hashable) -> int:
        return self.cache.match(token_ids, tenant=instance)[0]

    def choose_prefill(self, token_ids: Sequence[int]) -> Hashable:
        hits = {p: self.local_hit(token_ids, p) for p in self.prefill_instances}
        best = max(hits.values())
        order = {p: i for i, p in enumerate(self.prefill_instances)}
        candidates = [p for p in self.prefill_instances if hits[p] == best]
        return min(candidates, key=lambda p: (self.prefill_load[p], order[p]))

    def choose_decode(self) -> Hashable:
        return min(self.decode_instances, key=lambda d: self.decode_load[d])

    def prefill(self, request_id: Hashable, token_ids: Sequence[int]) -> Hashable:
        if request_id in self._prefilling or request_id in self._decoding:
            raise ValueError(f"request {request_id!r} is already in flight")
        p = self.choose_prefill(token_ids)
        self.cache.insert(token_ids, p, self.clock())
        if self.cache_capacity_tokens is not None:
            self.cache.evict_tenant(p, self.cache_capacity_tokens)
        self.prefill_load[p] += 1
        self._prefilling[request_id] = (p, len(token_ids))
        return p

    def complete_prefill(self, request_id: Hashable) -> KVTransfer:
        p, tokens = self._prefilling.pop(request_id)
        self.prefill_load[p] -= 1
        d = self.choose_decode()
        self.decode_load[d] += 1
        self._decoding[request_id] = d
        t = KVTransfer(request_id, p, d, tokens, tokens * self.kv_bytes_per_token)
        self.transfers.append(t)
        return t

    def route(self, request_id: Hashable, token_ids: Sequence[int]) -> KVTransfer:
        """Prefill and hand over in one step (a simulator with no prefill latency)."""
        self.prefill(request_id, token_ids)
        return self.complete_prefill(request_id)

    def finish(self, request_id: Hashable) -> Hashable:
        d = self._decoding.pop(request_id)
        self.decode_load[d] -= 1
        return d
