"""The cost model: segment-size threshold, iteration latency, and TokenLake's cache load.

Three parts (paper §4.2 and §6.1, docs/design.md §5):

* :func:`segment_threshold` -- the smallest segment size C (tokens) for which querying a
  remote segment saves at least as much compute time as the communication costs.
* :class:`LatencyModel` -- a quadratic iteration-time model fitted by least squares (as
  LoongServe fits it), with :func:`roofline_samples` to fit one from a roofline when no
  measurements exist.
* :func:`get_cache_load` -- the fraction of GPU resources TokenLake itself consumes for
  a set of requests in the worst case.

The paper writes its formulas for fp16 multi-head attention with hidden size ``d``; here
they are generalised to grouped-query attention and any dtype through the
:class:`~tokenlake.core.specs.ModelSpec` properties (each reduces to the paper's ``4d`` for
Llama-2-7B in fp16). Pure Python at import time: numpy/scipy are imported lazily in
:meth:`LatencyModel.fit` only.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from importlib import resources
from typing import Any

from tokenlake.core.errors import ConfigError
from tokenlake.core.specs import HardwareProfile, ModelSpec

# --------------------------------------------------------------------------- threshold


def comm_bytes_per_query_layer(model: ModelSpec) -> int:
    """Bytes moved per query row and layer in the threshold formula (the paper's ``4d``).

    The query row goes out and its output row comes back, both counted in the model
    dtype: ``2 * q_heads * head_dim * dtype_bytes`` (= 16384 = 4d for Llama-2-7B fp16).
    The wire actually returns float32 ``o`` plus ``lse``
    (:attr:`ModelSpec.partial_bytes_per_token_layer`); we keep the paper's count so the
    threshold reproduces its published figure -- the difference is a few ns per layer,
    far below the latency term.
    """
    o_bytes = model.num_q_heads * model.head_dim * model.dtype_bytes
    return model.q_bytes_per_token_layer + o_bytes


def compute_s_per_prefix_token(model: ModelSpec, hw: HardwareProfile) -> float:
    """``k_comp``: seconds one query row spends per cached token per layer (roofline).

    ``max(attn_flops / F, kv_bytes / B_mem)`` with the per-token-per-layer FLOPs and KV
    bytes of :class:`ModelSpec` (the paper's ``max(4d/F, 4d/B_mem)``).
    """
    compute = model.attn_flops_per_query_prefix_token_layer / hw.flops
    memory = model.kv_bytes_per_token_layer / hw.mem_bw
    return max(compute, memory)


def comm_overhead_s(model: ModelSpec, hw: HardwareProfile) -> float:
    """Seconds of communication per remote segment query, per layer and query row.

    ``2 * alpha_net + comm_bytes / B_net`` (paper §4.2: 4.66 us on A100/NVLink).
    """
    return 2.0 * hw.net_latency_s + comm_bytes_per_query_layer(model) / hw.net_bw


def segment_threshold(model: ModelSpec, hw: HardwareProfile) -> float:
    """Smallest segment size, in tokens, whose saved compute covers the communication.

    ``C >= 2*alpha_net/k_comp + comm_bytes/(k_comp*B_net)`` (paper §4.2); about 569
    tokens for Llama-2-7B on the A100 profile.
    """
    return comm_overhead_s(model, hw) / compute_s_per_prefix_token(model, hw)


def default_segment_tokens(model: ModelSpec, hw: HardwareProfile, multiple: int = 64) -> int:
    """The threshold rounded *up* to a multiple of ``multiple`` tokens, at least ``multiple``.

    Rounding up keeps C above the threshold; a multiple of 64 keeps segments aligned
    to attention-kernel tiles and page sizes.
    """
    if not isinstance(multiple, int) or multiple <= 0:
        raise ConfigError(f"multiple must be a positive int, got {multiple!r}")
    blocks = math.ceil(segment_threshold(model, hw) / multiple)
    return max(1, blocks) * multiple


# --------------------------------------------------------------------------- latency

BatchTokens = Sequence[tuple[int, int]]  # (new_tokens, prefix_tokens) per request


@dataclass(frozen=True)
class LatencySample:
    """One measured (or synthetic) iteration: a batch run on ``k`` instances."""

    requests: tuple[tuple[int, int], ...]  # (new_tokens, prefix_tokens) per request
    k: int  # instances the batch ran on (degree of sequence parallelism)
    seconds: float  # iteration wall time


def _check_k(k: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"k (instances) must be an int >= 1, got {k!r}")


def batch_features(requests: BatchTokens, k: int = 1, speedup: float | None = None) -> tuple[float, ...]:
    """Features of a batch, in the order of :class:`LatencyModel`'s coefficients.

    ``(1, S_new/s, S_new*prefix/s, S_new^2/s, S_prefix/s, num_requests)``: the
    token-proportional terms are shared by the ``k`` instances, which compute them ``s``
    times faster than one (``speedup``; default ``k``, perfect parallelism); the fixed
    iteration cost and the per-request cost are paid in full on each instance, so they
    do not divide.
    """
    _check_k(k)
    s = float(k) if speedup is None else speedup
    new = new_prefix = new_sq = prefix = 0.0
    for n, p in requests:
        if n < 0 or p < 0:
            raise ConfigError(f"token counts must be >= 0, got new={n}, prefix={p}")
        new += n
        new_prefix += n * p
        new_sq += n * n
        prefix += p
    return (1.0, new / s, new_prefix / s, new_sq / s, prefix / s, float(len(requests)))


@dataclass(frozen=True)
class LatencyModel:
    """Quadratic iteration-time model ``T(batch, k)`` (paper §6.1, LoongServe's fit).

    ``T = c_const + c_request*n + (c_new*S_new + c_new_prefix*S_np + c_new_sq*S_nn
    + c_prefix*S_p) / k`` where, over the n requests of the batch, ``S_new`` sums new
    tokens, ``S_np`` sums new*prefix tokens, ``S_nn`` sums new^2 and ``S_p`` sums prefix
    tokens. All coefficients are non-negative seconds per unit of their feature.

    ``dop_speedup[k-1]``, when given, is how much faster ``k`` instances compute the
    divided terms than one, as measured (``tokenlake profile-latency``): ``/ k`` above
    becomes ``/ dop_speedup[k-1]`` (the last value for larger ``k``). Empty: ``k``, the
    perfect parallelism of instances with their own devices. On a machine whose
    instances share a few cores it is near 1 (docs/scheduling.md). ``query_message_s``
    and ``query_work_scale``: what one query message costs a query engine, and its busy
    time per second of the prefix terms (measured; the simulator charges both to the
    instances' busy time, :mod:`evals.sim.instance_load`).
    """

    c_const: float  # s per iteration
    c_new: float  # s per new token
    c_new_prefix: float  # s per (new token x prefix token)
    c_new_sq: float  # s per (new token)^2
    c_prefix: float  # s per prefix token
    c_request: float  # s per request
    dop_speedup: tuple[float, ...] = ()
    query_message_s: float = 0.0  # a query engine's handling time per query message (measured)
    query_work_scale: float = 1.0  # its busy time per second of the prefix terms (measured)

    def __post_init__(self) -> None:
        for f in fields(self)[:6]:
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"LatencyModel.{f.name} must be finite and >= 0, got {value!r}")
        sp = tuple(float(x) for x in self.dop_speedup)
        if sp and (sp[0] != 1.0 or not all(math.isfinite(x) and x > 0 for x in sp)):
            raise ConfigError(f"dop_speedup must start with 1.0 and be finite and > 0, got {list(sp)}")
        object.__setattr__(self, "dop_speedup", sp)
        for name in ("query_message_s", "query_work_scale"):
            q = getattr(self, name)
            if not isinstance(q, (int, float)) or not math.isfinite(q) or q < 0:
                raise ConfigError(f"{name} must be finite and >= 0, got {q!r}")

    def speedup(self, k: int) -> float:
        """How many times faster ``k`` instances compute the divided terms than one."""
        sp = self.dop_speedup
        return float(k) if not sp else sp[min(k, len(sp)) - 1]

    @property
    def coefficients(self) -> tuple[float, ...]:
        """Coefficients in the order of :func:`batch_features`."""
        return (self.c_const, self.c_new, self.c_new_prefix, self.c_new_sq, self.c_prefix,
                self.c_request)

    def predict(self, requests: BatchTokens, k: int = 1) -> float:
        """Iteration time in seconds of ``requests`` ((new, prefix) token pairs) on k instances."""
        return sum(c * x for c, x in zip(self.coefficients, batch_features(requests, k, self.speedup(k)),
                                          strict=True))

    @classmethod
    def fit(cls, samples: Iterable[LatencySample]) -> LatencyModel:
        """Non-negative least squares on relative error (each row weighted by 1/seconds).

        Columns are scaled to unit max before solving so that features spanning ten
        orders of magnitude stay well conditioned.
        """
        # Imported here: the core loads without numpy and scipy (tests/test_pure_import.py);
        # only fitting a model needs them.
        import numpy as np
        from scipy.optimize import nnls

        samples = list(samples)
        if len(samples) < 6:
            raise ConfigError(f"need at least 6 samples to fit 6 coefficients, got {len(samples)}")
        x = np.array([batch_features(s.requests, s.k) for s in samples], dtype=np.float64)
        y = np.array([s.seconds for s in samples], dtype=np.float64)
        if not np.all(y > 0):
            raise ConfigError("sample times must be > 0 seconds")
        x /= y[:, None]
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        coef, _ = nnls(x / scale, np.ones_like(y), maxiter=50 * x.shape[1])
        return cls(*(float(c) for c in coef / scale))

    def to_dict(self) -> dict[str, float]:
        """The coefficients by field name (JSON-serialisable; ``dop_speedup`` apart)."""
        out = asdict(self)
        del out["dop_speedup"], out["query_message_s"], out["query_work_scale"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], dop_speedup=(), query_message_s: float = 0.0,
                  query_work_scale: float = 1.0) -> LatencyModel:
        """Inverse of :meth:`to_dict`; unknown or missing keys raise :class:`ConfigError`."""
        names = [f.name for f in fields(cls)][:6]
        if sorted(data) != sorted(names):
            raise ConfigError(f"LatencyModel needs exactly the keys {names}, got {sorted(data)}")
        return cls(**{k: float(v) for k, v in data.items()}, dop_speedup=tuple(dop_speedup),
                   query_message_s=float(query_message_s), query_work_scale=float(query_work_scale))

    @staticmethod
    def document(name: str) -> dict[str, Any]:
        """The whole shipped file ``tokenlake/data/latency/<name>.json`` (coefficients, fit,
        samples, the machine it was measured on)."""
        folder = resources.files("tokenlake").joinpath("data", "latency")
        valid = sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))
        if name not in valid:
            raise ConfigError(f"unknown latency model {name!r}; valid names: {', '.join(valid)}")
        return json.loads(folder.joinpath(f"{name}.json").read_text(encoding="utf-8"))

    @classmethod
    def load(cls, name: str) -> LatencyModel:
        """The shipped model ``tokenlake/data/latency/<name>.json`` (its "coefficients")."""
        data = cls.document(name)
        qe = data.get("query_engine", {})
        return cls.from_dict(data["coefficients"], data.get("dop_speedup", ()),
                             qe.get("message_s", 0.0), qe.get("work_scale", 1.0))


def fit_report(model: LatencyModel, samples: Iterable[LatencySample]) -> dict[str, float]:
    """Relative prediction errors ``|pred - t| / t`` over ``samples``: mean, p50, p90, max."""
    errs = sorted(abs(model.predict(s.requests, s.k) - s.seconds) / s.seconds for s in samples)
    if not errs:
        raise ConfigError("fit_report needs at least one sample")

    def quantile(q: float) -> float:
        return errs[min(len(errs) - 1, int(q * len(errs)))]

    return {"n_samples": len(errs), "mean_rel_err": sum(errs) / len(errs),
            "p50_rel_err": quantile(0.5), "p90_rel_err": quantile(0.9), "max_rel_err": errs[-1]}


# --------------------------------------------------------------------------- roofline


def roofline_seconds(model: ModelSpec, hw: HardwareProfile, requests: BatchTokens, k: int = 1,
                     overhead_s: float = 1e-3) -> float:
    """Roofline iteration time (seconds) of a batch split over ``k`` instances.

    Compute: linear layers ``2*num_params`` FLOPs per new token plus attention
    ``attn_flops*layers*new*(prefix + new/2)`` (causal over the new tokens). Memory: the
    weights (read in full on every instance) plus KV read (prefix and new tokens) and KV
    written (new tokens). Token work divides by k; ``time = max(compute/F, bytes/B_mem)
    + overhead_s``.
    """
    _check_k(k)
    attn = model.attn_flops_per_query_prefix_token_layer * model.num_layers
    flops = sum(2 * model.num_params * n + attn * n * (p + n / 2) for n, p in requests) / k
    kv_tokens = sum(p + 2 * n for n, p in requests)  # read prefix+new, write new
    weight_bytes = model.num_params * model.dtype_bytes
    mem = weight_bytes + model.kv_bytes_per_token * kv_tokens / k
    return max(flops / hw.flops, mem / hw.mem_bw) + overhead_s


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _random_batch(rng: random.Random, max_context: int, capacity: int) -> list[tuple[int, int]]:
    """A decode batch (new=1, up to 256 requests) or a prefill batch (up to 8 requests)."""
    batch = []
    if rng.random() < 0.5:
        for _ in range(rng.randint(1, 256)):
            batch.append((1, _log_uniform(rng, 1, max_context - 1)))
    else:
        for _ in range(rng.randint(1, 8)):
            new = _log_uniform(rng, 1, min(max_context, 8192))
            batch.append((new, rng.randint(0, max_context - new)))
    while len(batch) > 1 and sum(n + p for n, p in batch) > capacity:
        batch.pop()  # keep the batch's KV within the instances' memory
    return batch


def roofline_samples(model: ModelSpec, hw: HardwareProfile, n_samples: int = 500,
                     seed: int = 0, ks: Sequence[int] = (1, 2, 4, 8),
                     max_context: int | None = None,
                     overhead_s: float = 1e-3) -> list[LatencySample]:
    """Synthetic :class:`LatencySample` s from :func:`roofline_seconds`, reproducible by seed.

    Half decode, half prefill batches with context lengths up to ``max_context`` tokens
    (default ``model.max_context``), on k drawn from ``ks``, trimmed so their KV fits
    the k instances' memory left after the weights.
    """
    max_context = max_context or model.max_context
    if max_context < 2:
        raise ConfigError(f"max_context must be >= 2 tokens, got {max_context}")
    free = hw.mem_bytes - model.num_params * model.dtype_bytes
    if free <= 0:
        raise ConfigError(f"{model.name} weights do not fit in {hw.name} memory")
    rng = random.Random(seed)
    out = []
    for _ in range(n_samples):
        k = rng.choice(list(ks))
        batch = _random_batch(rng, max_context, int(k * free // model.kv_bytes_per_token))
        secs = roofline_seconds(model, hw, batch, k, overhead_s)
        out.append(LatencySample(tuple(batch), k, secs))
    return out


# --------------------------------------------------------------------------- cache load


@dataclass(frozen=True)
class LoadRequest:
    """One request of an iteration, as :func:`get_cache_load` sees it."""

    input_len: int  # new tokens computed this iteration
    prefix_len: int  # cached prefix tokens the pool attends over


def get_cache_load(reqs: Sequence[LoadRequest], n_instances: int, model: ModelSpec,
                   hw: HardwareProfile, latency: LatencyModel) -> float:
    """Worst-case fraction of the instances' resources TokenLake uses for ``reqs`` (paper §6.1).

    ``M_r = sum kv_bytes_per_token*(prefix_len + input_len)`` bytes (prefix KV read by
    queries plus new KV written by puts, all layers: the paper's ``4d`` per layer).
    ``F_r = sum layers*attn_flops*prefix_len*input_len`` FLOPs of prefix attention. The
    paper writes ``2d`` here, half of the ``4Cd`` it uses for the same attention in
    §4.2; we count ``4*q_heads*head_dim`` per (query, cached token) pair consistently
    with §4.2 and with ``F`` in FLOP/s. ``T_r = latency.predict(reqs, k=N)``, the time
    with all N instances used. ``L = max(M_r/(M_r + N*B_mem*T_r),
    F_r/(F_r + N*F*T_r))`` in ``[0, 1)``; 0.0 for no requests.
    """
    _check_k(n_instances)
    if not reqs:
        return 0.0
    attn = model.num_layers * model.attn_flops_per_query_prefix_token_layer
    mem = sum(model.kv_bytes_per_token * (r.prefix_len + r.input_len) for r in reqs)
    flops = sum(attn * r.prefix_len * r.input_len for r in reqs)
    t = latency.predict([(r.input_len, r.prefix_len) for r in reqs], k=n_instances)

    def share(used: float, capacity_per_s: float) -> float:
        total = used + n_instances * capacity_per_s * t
        return used / total if total > 0 else 0.0

    return max(share(mem, hw.mem_bw), share(flops, hw.flops))
