"""What a simulation measures, and the paper's metric definitions (§7).

Per request: time to first token (TTFT), every time between tokens (TBT), hit tokens.

* **Input token latency** = TTFT / input length (paper §7, after LoongServe).
* **Output token latency** = the request's mean TBT, ``(t_last - t_first) / (out - 1)``.
* **SLO attainment** = share of requests whose input token latency *and every* token
  latency are at most ``slo_scale`` (10) x their batch-size-1 time: TTFT <= 10 x the
  request's chunked prefill alone on one instance without a cache hit
  (:func:`~evals.sim.timing.prefill_bs1_s`), and every TBT <= 10 x one decode step of
  the request alone (:func:`~evals.sim.timing.decode_bs1_s`); absolute per-token SLOs can
  replace both (docs/design.md §7: "every token latency under 10x its batch-size-1 time").
* **P90 goodput** = the highest request rate at which >= 90% of requests meet the SLO
  (a sweep over rates: :func:`evals.sim.systems.p90_goodput`).
* **Hit rate** = prefix-hit input tokens / input tokens.
* **CV** = mean over time windows of the coefficient of variation (population std /
  mean) of per-instance cache accesses, i.e. KV tokens read from each instance's cache
  memory in that window; windows with no access are skipped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from tokenlake.core.placement import coefficient_of_variation


@dataclass(frozen=True)
class SimResult:
    """One simulated run. Times in seconds; rates per second of simulated time."""

    system: str
    instances: int
    requests: int  # finished requests
    hit_rate: float
    cv: float
    mean_ttft_s: float
    p90_ttft_s: float
    mean_tbt_s: float  # over every inter-token gap of every request
    p90_tbt_s: float
    input_token_latency_s: float  # mean over requests of TTFT / input length
    output_token_latency_s: float  # mean over requests (>= 2 tokens) of their mean TBT
    slo_attainment: float
    ttft_slo_attainment: float
    tbt_slo_attainment: float
    #: of the requests that missed the TBT SLO, the share whose longest gap spans a wait
    #: between two batches (descheduled while others ran) rather than one slow step
    tbt_miss_waited: float
    throughput_rps: float  # finished requests / (last finish - first arrival)
    output_tokens_per_s: float
    input_tokens: int
    hit_tokens: int
    prefill_tokens: int
    generated_tokens: int
    makespan_s: float
    sim_wall_s: float  # wall time of the simulation itself
    sim_cpu_s: float  # CPU time of this process during it (steadier on a shared machine)
    events: int  # discrete events processed (arrivals, run ends, copies, ...)
    events_per_s: float
    iterations: int  # simulated batch iterations (decode steps and prefill chunks)
    iterations_per_s: float
    scheduler_calls: int
    plan_calls: int  # ControlPlane.gen_plans calls (0 for the baselines)
    extra: dict = field(default_factory=dict)  # system-specific counters
    cv_over_time: tuple[float, ...] = ()

    def to_dict(self, series: bool = False) -> dict:
        """JSON-ready dict; ``series`` keeps the per-window CVs and the timeline of the
        instances per phase (``extra["phase_timeline"]``, pooled systems)."""
        d = asdict(self)
        if not series:
            d.pop("cv_over_time")
            d["extra"].pop("phase_timeline", None)
        return d


class Recorder:
    """Collects per-request latencies, TBT samples and per-instance cache reads."""

    def __init__(self, instances: list, window_s: float) -> None:
        self.instances = list(instances)
        self._col = {inst: i for i, inst in enumerate(self.instances)}
        self.window_s = window_s
        self.windows: dict[int, list[float]] = {}
        self.rows: list[tuple] = []  # one per finished request
        self._gaps: list[float] = []  # TBTs recorded one by one
        self._runs: list[tuple] = []  # (a, b, j_from, j_to, weight) decode step blocks
        self._arrays: list[tuple] = []  # (durations, weight) decode step blocks
        self.input_tokens = self.hit_tokens = self.prefill_tokens = self.generated = 0

    # ---------------------------------------------------------------- TBTs
    def gap(self, req, t: float, step: float = 0.0) -> None:
        """A token of ``req`` at ``t`` (its first is recorded by :meth:`first_token`) from
        a step of ``step`` seconds: the rest of the gap the request waited unscheduled."""
        d = t - req.last_token_s
        self._gaps.append(d)
        req.tbt_sum += d
        req.tbt_count += 1
        if d > req.tbt_max:
            req.tbt_max, req.tbt_max_waited = d, d - step > step
        req.last_token_s = t

    def steps(self, sched, j_from: int, j_to: int, reqs) -> None:
        """Steps ``j_from..j_to`` (1-based, inclusive) of a decode schedule gave one token
        to each of ``reqs`` (whose previous token is step ``j_from - 1``)."""
        if j_to < j_from:
            return
        if hasattr(sched, "durations"):  # explicit durations
            ds = sched.durations[j_from - 1:j_to]
            self._arrays.append((np.asarray(ds), len(reqs)))
            total, longest = sum(ds), max(ds)
        else:  # linear: step j lasts a + b (j-1)
            self._runs.append((sched.a, sched.b, j_from, j_to, len(reqs)))
            total = (j_to - j_from + 1) * sched.a + sched.b * (
                (j_to - 1) * j_to - (j_from - 2) * (j_from - 1)) / 2
            longest = sched.duration(j_to)
        end = sched.end(j_to)
        n = j_to - j_from + 1
        for r in reqs:
            r.tbt_sum += total
            r.tbt_count += n
            if longest > r.tbt_max:
                r.tbt_max, r.tbt_max_waited = longest, False
            r.last_token_s = end

    def first_token(self, req, t: float) -> None:
        req.first_token_s = req.last_token_s = t

    def finish(self, req, ttft_slo_s: float, tbt_slo_s: float) -> None:
        ttft = req.first_token_s - req.arrival_s
        self.rows.append((req.arrival_s, req.last_token_s, req.prompt_len, req.output_len,
                          ttft, req.tbt_sum, req.tbt_count,
                          ttft <= ttft_slo_s * (1 + 1e-9),
                          req.tbt_count == 0 or req.tbt_max <= tbt_slo_s * (1 + 1e-9),
                          req.tbt_max_waited))
        self.input_tokens += req.prompt_len
        self.hit_tokens += req.hit
        self.generated += req.output_len

    # ------------------------------------------------------- cache accesses
    def reads(self, t: float, per_instance: dict, times: int = 1) -> None:
        """``times`` x ``per_instance`` KV tokens read at ``t``."""
        row = self.windows.get(int(t // self.window_s))
        if row is None:
            row = self.windows[int(t // self.window_s)] = [0.0] * len(self.instances)
        col = self._col
        for inst, n in per_instance.items():
            row[col[inst]] += n * times

    def run_reads(self, sched, j0: int, j1: int, per_instance: dict) -> None:
        """Steps ``j0+1 .. j1`` of a schedule each read ``per_instance``."""
        j, w = j0, self.window_s
        while j < j1:
            t = sched.end(j + 1)
            boundary = (int(t // w) + 1) * w
            jn = max(j + 1, min(j1, sched.steps_done_by(boundary)))
            self.reads(t, per_instance, jn - j)
            j = jn

    def cv_series(self) -> list[float]:
        """Access CV of every window with reads, in time order."""
        return [coefficient_of_variation(self.windows[k]) for k in sorted(self.windows)
                if sum(self.windows[k]) > 0]

    # -------------------------------------------------------------- summary
    def tbt_samples(self) -> tuple[np.ndarray, np.ndarray]:
        """Every TBT and its weight (number of tokens that had it)."""
        vals = [np.asarray(self._gaps, dtype=np.float64)]
        wts = [np.ones(len(self._gaps))]
        for a, b, j0, j1, n in self._runs:
            j = np.arange(j0, j1 + 1, dtype=np.float64)
            vals.append(a + b * (j - 1))
            wts.append(np.full(len(j), float(n)))
        for ds, n in self._arrays:
            vals.append(ds)
            wts.append(np.full(len(ds), float(n)))
        return np.concatenate(vals), np.concatenate(wts)

    def summary(self) -> dict:
        rows = self.rows
        if not rows:
            raise RuntimeError("no request finished")
        arr = np.array([r[:7] for r in rows], dtype=np.float64)
        arrival, last, inp, out, ttft, tsum, tcount = arr.T
        ok_in = np.array([r[7] for r in rows])
        ok_out = np.array([r[8] for r in rows])
        waited = np.array([r[9] for r in rows])
        vals, wts = self.tbt_samples()
        multi = tcount > 0
        span = float(last.max() - arrival.min())
        cvs = self.cv_series()
        return {
            "requests": len(rows),
            "hit_rate": self.hit_tokens / self.input_tokens if self.input_tokens else 0.0,
            "cv": float(np.mean(cvs)) if cvs else 0.0,
            "cv_over_time": tuple(cvs),
            "mean_ttft_s": float(ttft.mean()),
            "p90_ttft_s": float(np.percentile(ttft, 90)),
            "mean_tbt_s": float(np.average(vals, weights=wts)) if wts.sum() else 0.0,
            "p90_tbt_s": _weighted_quantile(vals, wts, 0.9),
            "input_token_latency_s": float((ttft / inp).mean()),
            "output_token_latency_s": float((tsum[multi] / tcount[multi]).mean()) if multi.any() else 0.0,
            "slo_attainment": float((ok_in & ok_out).mean()),
            "ttft_slo_attainment": float(ok_in.mean()),
            "tbt_slo_attainment": float(ok_out.mean()),
            "tbt_miss_waited": float(waited[~ok_out].mean()) if (~ok_out).any() else 0.0,
            "throughput_rps": len(rows) / span if span > 0 else 0.0,
            "output_tokens_per_s": float(out.sum()) / span if span > 0 else 0.0,
            "input_tokens": self.input_tokens,
            "hit_tokens": self.hit_tokens,
            "prefill_tokens": self.prefill_tokens,
            "generated_tokens": self.generated,
            "makespan_s": span,
        }


def _weighted_quantile(vals: np.ndarray, wts: np.ndarray, q: float) -> float:
    """The smallest value whose cumulative weight reaches ``q`` of the total (0 if none)."""
    if not len(vals) or wts.sum() <= 0:
        return 0.0
    order = np.argsort(vals, kind="stable")
    cum = np.cumsum(wts[order])
    idx = int(np.searchsorted(cum, q * cum[-1], side="left"))
    return float(vals[order][min(idx, len(vals) - 1)])


def as_result(system: str, instances: int, summary: dict, **rest) -> SimResult:
    """A :class:`SimResult` from :meth:`Recorder.summary` plus run counters."""
    return SimResult(system=system, instances=instances, **summary, **rest)
