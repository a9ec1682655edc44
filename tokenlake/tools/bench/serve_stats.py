"""The figures of ``tokenlake bench serve``: percentiles, the report of one run, the
median report over rounds, the pool-vs-baseline ratios, and the human-readable table.

Latency statistics are ``{p50, p90, p99, mean}`` in milliseconds; percentiles
interpolate linearly between the closest ranks, as numpy's default does.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

HIT_COUNTER = "tokenlake_hit_tokens_total"
LOOKUP_COUNTER = "tokenlake_lookup_tokens_total"
LATENCIES = ("ttft", "tbt", "e2e")
THROUGHPUTS = ("throughput_rps", "output_tokens_per_s")
STAT_KEYS = ("p50", "p90", "p99", "mean")


# --------------------------------------------------------------------------- statistics


def percentile(values: list[float], p: float) -> float:
    """The ``p``-th percentile (0-100) of ``values`` with linear interpolation between
    the closest ranks (numpy's default); ValueError if empty."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100.0
    lo = int(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def distribution(values: list[float], scale: float = 1.0) -> dict | None:
    """``{p50, p90, p99, mean}`` of ``values`` times ``scale``; None if there are none."""
    if not values:
        return None
    xs = [v * scale for v in values]
    return {"p50": percentile(xs, 50), "p90": percentile(xs, 90), "p99": percentile(xs, 99),
            "mean": statistics.fmean(xs)}


@dataclass
class Outcome:
    """What one request did (times in seconds from sending it)."""

    request_id: str
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""  # the answer (compared between the pool and the baseline)


def summarise(outcomes: list[Outcome], duration_s: float, counters: tuple | None = None,
              input_tokens: int = 0) -> dict:
    """The report of one run; ``counters`` is ``(before, after)`` of :func:`parse_metrics`."""
    ok = [o for o in outcomes if o.error is None]
    out_tokens = sum(o.output_tokens for o in ok)
    hit_rate, source = None, None
    if counters and counters[0] is not None and counters[1] is not None:
        looked = counters[1][LOOKUP_COUNTER] - counters[0][LOOKUP_COUNTER]
        if looked > 0:
            hit_rate = (counters[1][HIT_COUNTER] - counters[0][HIT_COUNTER]) / looked
            source = "metrics"
    if hit_rate is None:
        known = [o for o in ok if o.cached_tokens is not None and o.prompt_tokens]
        if known:
            hit_rate = sum(o.cached_tokens for o in known) / sum(o.prompt_tokens for o in known)
            source = "usage"
    errors = Counter(o.error for o in outcomes if o.error is not None)
    return {
        "requests": len(outcomes), "completed": len(ok), "errors": len(outcomes) - len(ok),
        "duration_s": duration_s,
        "throughput_rps": len(ok) / duration_s if duration_s > 0 else None,
        "output_tokens_per_s": out_tokens / duration_s if duration_s > 0 else None,
        "input_tokens": input_tokens, "output_tokens": out_tokens,
        "ttft_ms": distribution([o.ttft_s for o in ok if o.ttft_s is not None], 1e3),
        "tbt_ms": distribution([g for o in ok for g in o.gaps_s], 1e3),
        "e2e_ms": distribution([o.e2e_s for o in ok], 1e3),
        "hit_rate": hit_rate, "hit_rate_source": source,
        "error_samples": dict(errors.most_common(5)),
    }


def parse_metrics(text: str) -> dict | None:
    """The pool's hit and lookup token counters (summed over label sets) from Prometheus
    text; None when the text has neither."""
    found = {HIT_COUNTER: 0.0, LOOKUP_COUNTER: 0.0}
    seen = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(None, 1)[0]
        if name not in found:
            continue
        rest = line[len(name):]
        if rest.startswith("{"):
            rest = rest.rsplit("}", 1)[-1]
        try:
            found[name] += float(rest.split()[0])  # an optional timestamp may follow
        except (IndexError, ValueError):
            continue
        seen = True
    return found if seen else None



def median_and_range(values: list) -> tuple:
    xs = [v for v in values if v is not None]
    return (statistics.median(xs), [min(xs), max(xs)]) if xs else (None, None)


def aggregate(runs: list[dict]) -> dict:
    """One report from the runs of several rounds: counts summed, throughputs, hit rate
    and latency statistics the median over rounds with ``ranges`` (min, max); the
    rounds' own reports under ``rounds``. A single run is returned as it is."""
    if len(runs) == 1:
        return runs[0]
    out = {k: sum(r[k] for r in runs) for k in ("requests", "completed", "errors",
                                                "duration_s", "input_tokens", "output_tokens")}
    ranges = {}
    for key in (*THROUGHPUTS, "hit_rate"):
        out[key], ranges[key] = median_and_range([r[key] for r in runs])
    for lat in LATENCIES:
        dists = [r[f"{lat}_ms"] for r in runs if r[f"{lat}_ms"] is not None]
        out[f"{lat}_ms"] = {} if dists else None
        for k in STAT_KEYS if dists else ():
            out[f"{lat}_ms"][k], ranges[f"{lat}_ms.{k}"] = median_and_range([d[k] for d in dists])
    samples: Counter = Counter()
    for r in runs:
        samples.update(r["error_samples"])
    out.update(hit_rate_source=runs[0]["hit_rate_source"], error_samples=dict(samples),
               model=runs[0]["model"], url=runs[0]["url"], ranges=ranges, rounds=runs)
    return out


def ratios(pool: dict, baseline: dict) -> dict:
    """baseline/pool for TTFT, TBT and end-to-end statistics (> 1: the pool is faster),
    pool/baseline for throughputs (> 1: the pool serves more); None where undefined."""

    def div(a, b):
        return a / b if a is not None and b else None

    out = {}
    for lat in LATENCIES:
        p, b = pool[f"{lat}_ms"] or {}, baseline[f"{lat}_ms"] or {}
        for k in STAT_KEYS:
            out[f"{lat}_{k}"] = div(b.get(k), p.get(k))
    for key in THROUGHPUTS:
        out[key] = div(pool[key], baseline[key])
    return out


def _num(x, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _rows(r: dict) -> list[tuple[str, str]]:
    rows = [("requests (errors)", f"{r['requests']} ({r['errors']})"),
            ("requests/s", _num(r["throughput_rps"], ".2f")),
            ("output tokens/s", _num(r["output_tokens_per_s"])),
            ("hit rate", _num(r["hit_rate"], ".3f"))]
    for lat, label in (("ttft", "TTFT"), ("tbt", "TBT"), ("e2e", "end-to-end")):
        d = r[f"{lat}_ms"] or {}
        rows.append((f"{label} p50/p90/p99 ms",
                     "/".join(_num(d.get(k), ".0f") for k in ("p50", "p90", "p99"))))
    return rows


def format_report(result: dict) -> str:
    """A short table of a report (one server, or pool vs baseline with the ratios)."""
    if "pool" not in result:
        rows = _rows(result)
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
    else:
        pool, base, ratio = _rows(result["pool"]), _rows(result["baseline"]), result["ratios"]
        keys = [None, "throughput_rps", "output_tokens_per_s", None, "ttft_p50", "tbt_p50",
                "e2e_p50"]
        width = max(len(k) for k, _ in pool)
        lines = [f"{'':<{width}}  {'pool':>16}  {'baseline':>16}  ratio"]
        for (k, p), (_, b), rk in zip(pool, base, keys):
            extra = f"{ratio[rk]:.2f}x" if rk and ratio.get(rk) is not None else ""
            lines.append(f"{k:<{width}}  {p:>16}  {b:>16}  {extra}")
        lines.append("ratios: baseline/pool for latencies (p50), pool/baseline for throughputs")
    errors = result.get("error_samples") or {}
    for side in ("pool", "baseline"):
        errors = {**errors, **(result.get(side, {}).get("error_samples") or {})}
    lines += [f"error x{n}: {message}" for message, n in errors.items()]
    return "\n".join(lines)


# --------------------------------------------------------------------------- --mixed


def worker_summary(stats, worker: int, session: int | None) -> dict:
    """The report of one ``--mixed`` compute engine from its
    :class:`~tokenlake.tools.bench.serve_worker.WorkerStats` (any object with those
    fields): throughputs per second of running (``active_s``), latency percentiles of
    its iterations (ms; None without any), its counts, and up to 3 error samples."""
    lat = [x * 1e3 for x in stats.latencies_s]
    active = stats.active_s

    def per_s(x: float) -> float | None:
        return x / active if active > 0 else None

    return {"worker": worker, "session": session, "iterations": stats.iterations,
            "iterations_per_s": per_s(stats.iterations), "tokens_per_s": per_s(stats.tokens),
            "latency_p50_ms": percentile(lat, 50) if lat else None,
            "latency_p99_ms": percentile(lat, 99) if lat else None,
            "errors": stats.errors, "wrong_answers": stats.wrong_answers,
            "worst_error": stats.worst_error, "waits_in_flight": stats.waits_in_flight,
            "tokens": stats.tokens, "hit_tokens": stats.hit_tokens,
            "layers_checked": stats.layers_checked, "active_s": active,
            "error_samples": dict(stats.error_samples.most_common(3))}


def lost_worker(worker: int, why: str) -> dict:
    """The entry of a worker that ended without a report: one error, nothing checked."""
    return {"worker": worker, "session": None, "iterations": 0, "iterations_per_s": None,
            "tokens_per_s": None, "latency_p50_ms": None, "latency_p99_ms": None,
            "errors": 1, "wrong_answers": 0, "worst_error": None, "waits_in_flight": 0,
            "lost": True, "error_samples": {why[:500]: 1}}


def http_check(result: dict) -> dict:
    """The HTTP side of a ``--mixed`` run: the pool's failed requests, and its greedy
    answers that differ from the baseline's (``checked``: False, ``wrong_answers``
    None, when no baseline was compared)."""
    pool = result.get("pool", result)
    checked = "answers_compared" in result
    return {"errors": pool["errors"], "checked": checked,
            "answers_compared": result.get("answers_compared", 0),
            "wrong_answers": result["answers_differ"] if checked else None}


def mixed_report(workers: list[dict], http: dict) -> dict:
    """``"mixed"`` of the JSON report: the workers' entries (by worker number), their
    total wrong answers and errors (the HTTP side's are under ``http``)."""
    workers = sorted(workers, key=lambda w: w["worker"])
    return {"workers": workers, "wrong_answers": sum(w["wrong_answers"] for w in workers),
            "errors": sum(w["errors"] for w in workers), "http": http}


def format_mixed(mixed: dict) -> str:
    """One line per worker, then the totals."""
    lines = []
    for w in mixed["workers"]:
        worst = "-" if w["worst_error"] is None else f"{w['worst_error']:.1e}"
        lines.append(
            f"worker {w['worker']} (session {w['session']}): {w['iterations']} iterations, "
            f"{_num(w['iterations_per_s'], '.2f')} it/s, {_num(w['tokens_per_s'])} tokens/s, "
            f"latency p50/p99 {_num(w['latency_p50_ms'], '.0f')}/"
            f"{_num(w['latency_p99_ms'], '.0f')} ms, {w['errors']} errors, "
            f"{w['wrong_answers']} wrong (worst {worst}), {w['waits_in_flight']} waits")
        lines += [f"  error x{n}: {m}" for m, n in (w.get("error_samples") or {}).items()]
    http = mixed["http"]
    checked = (f"{http['wrong_answers']} of {http['answers_compared']} answers differ from "
               "the baseline" if http["checked"] else "answers not checked (no baseline)")
    lines.append(f"workers: {mixed['wrong_answers']} wrong answers, {mixed['errors']} errors; "
                 f"HTTP: {http['errors']} errors, {checked}")
    return "\n".join(lines)
