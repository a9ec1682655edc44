"""Typed configuration of one simulated cluster, and the figures derived from it.

:class:`SimConfig` is what a user sets (frozen, validated at construction);
:meth:`SimConfig.resolve` loads the model, hardware profile and latency model it names
and derives the sizes every backend needs (:class:`Setup`). Units: bytes, tokens,
seconds; ``cache_gb`` is decimal gigabytes (1e9 bytes) per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from scheduler.admission import ADMISSION_RULES
from scheduler.keep import DECODE_BATCH_RULES
from tokenlake.core.cost_model import LatencyModel, default_segment_tokens
from tokenlake.core.errors import ConfigError
from tokenlake.core.specs import HardwareProfile, ModelSpec, load_hardware, load_model

#: where a simulated tier lies (``SimConfig.tier_medium``)
TIER_MEDIA = ("disk", "host")

@dataclass(frozen=True)
class SimConfig:
    """One simulated cluster (defaults: the paper's §7 setup).

    Attributes:
        instances: GPUs in the cluster (TokenLake runs one instance per GPU).
        hardware: hardware profile name (``tokenlake/data/hardware.json``).
        model: model spec name (``tokenlake/data/models.json``); Llama-2-7B has the
            shape of the paper's LWM-Text-1M.
        latency: latency model name (``tokenlake/data/latency/``); default
            ``"<hardware>_<model>"``.
        cache_gb: KV-cache memory per GPU, 1e9 bytes; default: device memory minus the
            model's weights (66.5 GB for Llama-2-7B fp16 on an A100-80GB).
        segment_tokens: TokenLake's segment size ``C``; default
            :func:`tokenlake.core.cost_model.default_segment_tokens` (576 on the A100).
        chunk_tokens: chunked-prefill size, the same for every system (paper §7: "the
            same chunked prefill size"); default 512, the goodput scheduler's default.
            With the shipped A100 latency model the best per-token cost is near 1.1K
            tokens per instance (its fixed 6.4 ms per iteration against a quadratic
            term ``c_new_sq``): 8192-token chunks cost about twice as much per token.
        tp: tensor parallelism of the baselines' workers (paper §7: TP=2, so 8 GPUs
            are 4 workers, and Mooncake 1P3D is 1 prefill + 3 decode workers).
        slo_scale: SLO = ``slo_scale`` x the batch-size-1 time (paper §7: 10).
        input_token_slo_s / output_token_slo_s: absolute SLOs (seconds per input token,
            seconds between tokens) that replace the scaled batch-size-1 ones.
        cv_window_s: window over which per-instance cache accesses are summed for the CV.
        rebalance_s: period of TokenLake's heavy-hitter replication (``rebalance``); the
            paper gives none. 5 s against the pool's 10 s access window (one call costs
            2-20 ms of the control plane's CPU on a busy pool).
        router_evict_s: period of sgl-router's approximate-tree eviction.
        max_prefill_dop: cap on the DoP of TokenLake's prefill batches (None: N).
        pool_slowdown: also slow TokenLake's simulated iterations by ``1/(1-L)`` as the DP
            assumes (``scheduler/latency.py``). Off by default: the simulator already
            charges the prefix attention to the query engines of the instances that serve
            it (``evals/sim/instance_load.py``), so that would count it twice.
        closed_sessions: a multi-turn session's next turn is sent only when its previous
            turn has finished (a chat client waits for the answer), at the later of its
            own arrival time and that finish; its TTFT counts from then. False replays
            every arrival time as given (open loop), so a turn may arrive while the
            previous one still computes, before its KV can be reused.
        tier_gb: TokenLake's tier per GPU, 1e9 bytes (0: none): segments evicted from
            the pool stay there and are promoted on a hit (:mod:`tokenlake.core.tier`;
            docs/simulator.md "Disk tier").
        tier_medium: where that tier is: ``"disk"`` (read at the hardware profile's
            ``tier_read_bw``, an NVMe SSD on the GPU profiles) or ``"host"`` (host
            memory, at its ``host_tier_bw``: PCIe into the GPU).
        tier_read_gbs: the tier's read bandwidth per GPU, 1e9 bytes/s, instead of the
            profile's figure for ``tier_medium``.
        page_tokens: granularity of TokenLake's prefix hits inside a segment (None: the
            pool's default, 16; ``segment_tokens``: whole segments only).
        home_eviction: TokenLake's placement in a full pool: a new segment evicts at its
            hash home (the default, paper §4.3); False takes the global LRU victim's slot
            wherever it lives (the former rule, kept to compare the two).
        eviction_choices: with ``home_eviction``, instances whose LRU victims compete
            (2: the home and the next on the ring, the default; 1: the home only).
        admission: TokenLake's admission order in a full pool (:mod:`scheduler.admission`):
            ``cache-first`` (the default: overdue requests oldest first, then the longest
            ready prefix first; a request whose next segment is being computed waits for
            it) or ``fcfs`` (arrival order; the former rule, kept to compare).
        admission_patience: a request waiting longer than this multiple of its TTFT SLO
            is overdue: cache-first admission then takes it first, oldest first.
        decode_first: TokenLake places a decision's decode batches first, each on an
            instance free by the time its requests are ready, then its prefill
            sub-batches among the rest (True, the default); False matches every batch in
            one round by bytes alone (the rule before, kept to compare: decode batches
            then often wait for a prefill iteration to end, docs/evaluation.md "What sets
            TokenLake's knee").
        decode_batches: TokenLake's decode batches across decisions
            (:mod:`scheduler.keep`): ``keep`` (the default: a running decode batch stays
            together on its instance unless its SLO breaks or re-forming costs less with
            the moves counted) or ``reform`` (every decision batches every decode request
            afresh, the stateless DP; the rule before, kept to compare).
        grouped_reads: a decode batch reads shared prefix KV once for all its rows
            (cascade attention): TokenLake's query engines a segment several rows attend
            (as its CPU engines do, ``AttendLayout``), the baselines' workers the batch's
            common prefix (as vLLM's cascade kernel does); its ``c_prefix`` is charged
            once per batch, not per row. True by default (TokenLake's CPU and GPU query
            engines group the rows, ``AttendLayout``); False charges every row (to
            compare).
        seed: seed of every random choice (replica selection, Poisson arrivals).
    """

    instances: int = 8
    hardware: str = "a100-80gb"
    model: str = "llama-2-7b"
    latency: str | None = None
    cache_gb: float | None = None
    tier_gb: float = 0.0
    tier_medium: str = "disk"
    tier_read_gbs: float | None = None
    segment_tokens: int | None = None
    chunk_tokens: int = 512
    tp: int = 2
    slo_scale: float = 10.0
    input_token_slo_s: float | None = None
    output_token_slo_s: float | None = None
    cv_window_s: float = 1.0
    rebalance_s: float = 5.0
    router_evict_s: float = 60.0
    max_prefill_dop: int | None = None
    pool_slowdown: bool = False
    closed_sessions: bool = True
    page_tokens: int | None = None
    home_eviction: bool = True
    eviction_choices: int = 2
    admission: str = "cache-first"
    admission_patience: float = 2.0
    decode_first: bool = True
    decode_batches: str = "keep"
    grouped_reads: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("instances", "chunk_tokens", "tp", "eviction_choices"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.max_prefill_dop is not None and (
                not isinstance(self.max_prefill_dop, int) or self.max_prefill_dop < 1):
            raise ConfigError(f"max_prefill_dop must be a positive int or None, got {self.max_prefill_dop!r}")
        if self.segment_tokens is not None and (
                not isinstance(self.segment_tokens, int) or self.segment_tokens < 1):
            raise ConfigError(f"segment_tokens must be a positive int, got {self.segment_tokens!r}")
        if self.cache_gb is not None and not self.cache_gb > 0:
            raise ConfigError(f"cache_gb must be > 0, got {self.cache_gb!r}")
        if isinstance(self.tier_gb, bool) or not isinstance(self.tier_gb, (int, float)) or self.tier_gb < 0:
            raise ConfigError(f"tier_gb must be >= 0, got {self.tier_gb!r}")
        if self.tier_medium not in TIER_MEDIA:
            raise ConfigError(f"tier_medium must be one of {TIER_MEDIA}, got {self.tier_medium!r}")
        if self.tier_read_gbs is not None and not self.tier_read_gbs > 0:
            raise ConfigError(f"tier_read_gbs must be > 0 or None, got {self.tier_read_gbs!r}")
        if self.decode_batches not in DECODE_BATCH_RULES:
            raise ConfigError(f"decode_batches must be one of {DECODE_BATCH_RULES}, got {self.decode_batches!r}")
        if self.admission not in ADMISSION_RULES:
            raise ConfigError(f"admission must be one of {ADMISSION_RULES}, got {self.admission!r}")
        for name in ("slo_scale", "cv_window_s", "rebalance_s", "router_evict_s",
                     "admission_patience"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("input_token_slo_s", "output_token_slo_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0 or None, got {value!r}")

    def resolve(self) -> Setup:
        """Loads the named specs and derives per-GPU capacities."""
        model, hw = load_model(self.model), load_hardware(self.hardware)
        if self.tier_medium == "host":  # the simulator reads a tier at tier_read_bw
            hw = replace(hw, tier_read_bw=hw.host_tier_bw)
        if self.tier_read_gbs is not None:
            hw = replace(hw, tier_read_bw=self.tier_read_gbs * 1e9)
        latency = LatencyModel.load(self.latency or f"{self.hardware}_{self.model}")
        weights = model.num_params * model.dtype_bytes
        cache_bytes = self.cache_gb * 1e9 if self.cache_gb is not None else hw.mem_bytes - weights
        if cache_bytes <= 0:
            raise ConfigError(f"{self.model} weights do not fit in {self.hardware} memory")
        c = self.segment_tokens or default_segment_tokens(model, hw)
        slots = int(cache_bytes // model.segment_bytes(c))
        if slots < 1:
            raise ConfigError(f"cache_gb={self.cache_gb} holds no {c}-token segment")
        return Setup(self, model, hw, latency, c, slots,
                     int(cache_bytes // model.kv_bytes_per_token),
                     int(self.tier_gb * 1e9 // model.segment_bytes(c)))


@dataclass(frozen=True)
class Setup:
    """A resolved :class:`SimConfig`.

    Attributes:
        segment_tokens: ``C``.
        slots_per_instance: TokenLake segment slots per GPU (``cache_bytes // segment bytes``).
        cache_tokens_per_gpu: KV tokens one GPU's cache memory holds (baselines).
        tier_slots: segments each GPU's disk tier holds (0: no tier; TokenLake only).
    """

    config: SimConfig
    model: ModelSpec
    hardware: HardwareProfile
    latency: LatencyModel
    segment_tokens: int
    slots_per_instance: int
    cache_tokens_per_gpu: int
    tier_slots: int = 0

    @property
    def instances(self) -> int:
        return self.config.instances

    @property
    def chunk_tokens(self) -> int:
        return self.config.chunk_tokens
