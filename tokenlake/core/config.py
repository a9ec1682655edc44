"""Typed, validated configuration of the control plane: frozen, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from tokenlake.core.errors import ConfigError

#: Default granularity of prefix hits inside a segment (vLLM's block size too).
DEFAULT_PAGE_TOKENS = 16


@dataclass(frozen=True)
class PoolConfig:
    """How the global pool places, replicates and evicts segments.

    Attributes:
        segment_tokens: ``C``, tokens per segment (see
            :func:`tokenlake.core.cost_model.default_segment_tokens` for the paper's threshold).
        namespace: model id + KV layout; keys of different namespaces never collide.
        slots_per_instance: segment slots in each instance's slab.
        vnodes: virtual nodes per instance on the hash ring.
        window_s: length of the access-accounting window, seconds.
        bucket_s: granularity of that window, seconds.
        heavy_hitter_factor: heavy hitters tracked = ``factor * N * log2 N`` (at least N).
        replicate_high: replicate from an instance whose load exceeds mean x (1 + high).
        replicate_low: ... until its load is at most mean x (1 + low) (hysteresis).
        max_replications: cap on copies started by one rebalance round.
        seed: seed of the RNG used for power-of-two-choices replica selection.
        home_eviction: in a full pool a new segment evicts where its hash places it
            (paper §4.3, the default; see ``eviction_choices``); False takes the global
            LRU victim's slot wherever it lives (kept to compare the rules).
        eviction_choices: with ``home_eviction``, a full pool evicts the least recently
            used of the LRU victims on this many instances, the home and the next ones
            along the ring (2, the default: two choices, docs/design.md §4; 1: the home
            only).
        page_tokens: granularity of prefix hits inside a segment (docs/design.md §4):
            a match returns whole segments plus the matching leading pages of the next
            one. Must divide ``segment_tokens``; ``None`` (the default) means 16 where
            16 divides ``C`` and ``C`` (whole segments only) elsewhere.
        shared_memory: every query engine reads every instance's slab (one machine,
            ``LocalCluster(share_slabs=True)``; docs/data-plane.md "Co-located slabs"):
            the ready replica on the lowest instance serves every request, so that requests
            sharing segments share slots (attended once for all of them), and
            :meth:`~tokenlake.core.pool.CachePool.rebalance` starts no copy (a replica
            would move no work: the home's query engine attends them all).
        tier_slots: segments each instance's disk tier holds (0: no tier; segments
            evicted from the slabs are dropped). See :mod:`tokenlake.core.tier`.
    """

    segment_tokens: int
    namespace: str
    slots_per_instance: int
    vnodes: int = 64
    window_s: float = 10.0
    bucket_s: float = 1.0
    heavy_hitter_factor: float = 1.0
    replicate_high: float = 0.10
    replicate_low: float = 0.03
    max_replications: int = 64
    seed: int = 0
    page_tokens: int | None = None
    home_eviction: bool = True
    eviction_choices: int = 2
    shared_memory: bool = False
    tier_slots: int = 0

    def __post_init__(self) -> None:
        positive_int("segment_tokens", self.segment_tokens)
        positive_int("eviction_choices", self.eviction_choices)
        if self.page_tokens is None:
            page = DEFAULT_PAGE_TOKENS if self.segment_tokens % DEFAULT_PAGE_TOKENS == 0 \
                else self.segment_tokens
            object.__setattr__(self, "page_tokens", page)
        positive_int("page_tokens", self.page_tokens)
        if self.segment_tokens % self.page_tokens:
            raise ConfigError(f"page_tokens={self.page_tokens} must divide "
                              f"segment_tokens={self.segment_tokens}")
        positive_int("slots_per_instance", self.slots_per_instance)
        positive_int("vnodes", self.vnodes)
        positive_int("max_replications", self.max_replications)
        if not is_int(self.tier_slots) or self.tier_slots < 0:
            raise ConfigError(f"tier_slots must be an int >= 0, got {self.tier_slots!r}")
        if not self.namespace:
            raise ConfigError("namespace must be non-empty (model id + KV layout)")
        if not 0 < self.bucket_s <= self.window_s:
            raise ConfigError(f"need 0 < bucket_s <= window_s, got {self.bucket_s}, {self.window_s}")
        if self.heavy_hitter_factor < 0:
            raise ConfigError("heavy_hitter_factor must be >= 0")
        if not 0 <= self.replicate_low <= self.replicate_high:
            raise ConfigError("need 0 <= replicate_low <= replicate_high (hysteresis)")


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is an ``int`` to Python, not to a setting)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_device(value: object) -> bool:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"``: a device a pool and its model may live on."""
    text = str(value)
    return text in ("cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit())


def positive_int(name: str, value: object) -> None:
    """:class:`ConfigError` naming ``name`` unless ``value`` is an int of at least 1."""
    if not is_int(value) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
