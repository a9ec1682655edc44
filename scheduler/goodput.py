"""Goodput-optimized stateless elastic scheduling: the DP of paper §6.2 (docs/design.md §6).

Every iteration the scheduler decides, from scratch, how to batch all waiting and
running requests and how many instances (DoP) each batch gets. It minimises the total
latency ``sum over batches of (requests in batch) * T(batch, dop, L)`` subject to every
request's TBT SLO: a batch may only run if its iteration time ``T`` is at most the
smallest ``tbt_slo_s`` among its requests (requests with ``tbt_slo_s=None`` add no
constraint).

Choices made here (the paper leaves them open):

* **Phases.** A batch is one phase (PD disaggregation). The requests are ordered phase
  first (prefill, then decode), each phase by context length; a batch is a contiguous
  run that stays inside one phase. That makes the DP over the whole list the same as a
  DP per phase plus a split of the instances between the phases, which is how it is
  computed: ``f_p(i, k)`` over the prefill requests, ``f_d(i, k)`` over the decode
  requests, then ``min over k_p + k_d <= N`` of ``f_p(M_p, k_p) + f_d(M_d, k_d)``. The
  split between phases is thus elastic and decided every iteration.
* **DoP.** A decode batch runs on exactly one instance; a prefill batch on any number.
  ``f(i, k)`` uses exactly ``k`` instances; since more instances never slow a batch,
  the best plan uses as many as it can.
* **Chunked prefill.** A prefill request computes ``min(remaining_prefill,
  chunk_tokens)`` new tokens this iteration, attending over its ``context_tokens``
  prefix; a decode request computes one.
* **Cache load.** ``T = latency.predict(batch, dop) / (1 - L)`` with the snapshot's
  cache load (:mod:`scheduler.latency`).
* **Infeasible SLO.** If no plan meets every SLO, the DP is re-run without the SLO
  (throughput-first, to avoid head-of-line blocking) and ``Decision.note`` says so.
* **Memory.** The prefill DP uses three ``(M_p+1)^2 x D`` float64 tensors and a bool
  one; when one would exceed ``MAX_TENSOR_BYTES`` (256 MiB, e.g. ~720 prefill requests
  with all 64 DoPs) the DoPs are restricted to powers of two and the note says so. Up
  to ``KEEP_CELLS`` cells they are kept between decisions (one set per thread): fresh
  arrays of that size cost more in page faults than the DP's arithmetic.
* **Fewer free instances than phases.** With one free instance and both phases waiting,
  only the decode phase is scheduled (it protects the TBT) and the note says so.

Vectorised with numpy: per phase one ``(i, dop, j)`` cost tensor is built from prefix
sums of the latency model's per-request terms, then ``f(., k)`` for all ``i`` comes from
an argmin over ``(dop, j)`` per ``k`` (rows in a few blocks so that ``j >= i`` is mostly
skipped): ``O(M_p^2 N D + M_d^2 N)`` arithmetic in ``O(N)`` numpy calls, with ``D`` the
number of DoP choices (``N``, or ``log2 N`` with ``prefill_dops="pow2"``).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from scheduler.api import BatchDecision, Decision, RequestView, Snapshot
from scheduler.keep import DECODE_BATCH_RULES, KeptDecode, placed
from scheduler.latency import SLO_RTOL, slowdown, work_terms

DEFAULT_CHUNK_TOKENS = 512
MAX_TENSOR_BYTES = 256 << 20  # above this the exact prefill DP switches to pow2 DoPs


def _tensor_bytes(m_req: int, n_dops: int) -> int:
    """Bytes of one ``(i, dop, j)`` float64 tensor of the DP (it uses three)."""
    return (m_req + 1) ** 2 * n_dops * 8


@dataclass(frozen=True)
class Solution:
    """A decision with what the DP computed for it."""

    decision: Decision
    total_latency_s: float  # the DP objective: sum of requests x iteration time
    fell_back: bool  # True when the SLO could not be met and was ignored


def order(requests: tuple[RequestView, ...] | list[RequestView], phase: str) -> list[RequestView]:
    """The DP's order of one phase's requests: by context length, ties by id."""
    return sorted((r for r in requests if r.phase == phase),
                  key=lambda r: (r.context_tokens, r.request_id))


def new_tokens(req: RequestView, chunk_tokens: int) -> int:
    """Tokens ``req`` computes this iteration (chunked prefill; 1 in decode)."""
    return min(req.remaining_prefill, chunk_tokens) if req.phase == "prefill" else 1


#: Below this many inner DP steps (``N x M^2 x D / 2``) the DP runs in plain Python: a
#: few hundred numpy calls of fixed cost would take longer than the arithmetic. Both paths
#: evaluate the same float64 expressions in the same order and break ties the same way
#: (first minimum over ``(dop, j)``), so they return identical decisions.
SMALL_DP_STEPS = 2500


class _PhaseDP:
    """``f(i, k)`` over one phase's ordered requests, with its argmins for backtracking.

    ``dops`` are the DoPs a batch of this phase may take (``(1,)`` for decode). ``f``,
    ``arg_j`` and ``arg_m`` are indexed ``[i][k]`` (numpy arrays, or lists of lists on
    the small-problem path).
    """

    def __init__(self, snap: Snapshot, reqs: list[RequestView], chunk_tokens: int,
                 n: int, dops: tuple[int, ...], use_slo: bool, small: bool | None = None) -> None:
        self.reqs = reqs
        self.news = [new_tokens(r, chunk_tokens) for r in reqs]
        size = len(reqs) + 1
        if small is None:
            small = n * size * size * len(dops) <= 2 * SMALL_DP_STEPS
        if small:
            self._fill_python(snap, n, dops, use_slo)
        else:
            self._fill_numpy(snap, n, dops, use_slo)

    def _fill_numpy(self, snap: Snapshot, n: int, dops: tuple[int, ...], use_slo: bool) -> None:
        reqs = self.reqs
        m_req = len(reqs)
        size = m_req + 1
        self.f = np.full((size, n + 1), np.inf)
        self.f[0, 0] = 0.0
        self.arg_j = np.zeros((size, n + 1), dtype=np.int64)
        self.arg_m = np.zeros((size, n + 1), dtype=np.int64)
        if m_req == 0:
            return
        lat = snap.latency
        work = work_terms(lat, np.array(self.news), np.array([r.context_tokens for r in reqs]))
        wp = np.concatenate(([0.0], np.cumsum(work)))
        ws = _workspace(size, len(dops))
        count, invalid = ws.count[:size, :size], ws.invalid[:size, :size]  # [i, j] = i - j
        times = ws.take("times", size, len(dops), size)  # [i, m, j], as scheduler.latency.batch_times
        diff, fixed = ws.diff[:size, :size], ws.fixed[:size, :size]
        scale = slowdown(snap.cache_load)
        np.subtract(wp[:, None], wp[None, :], out=diff)
        diff *= scale
        np.multiply(count, lat.c_request, out=fixed)
        fixed += lat.c_const
        fixed *= scale
        np.multiply(diff[:, None, :], 1.0 / np.asarray([lat.speedup(d) for d in dops])[None, :, None],
                    out=times)
        times += fixed[:, None, :]
        cost = ws.take("cost", size, len(dops), size)
        np.multiply(times, count[:, None, :], out=cost)
        np.copyto(cost, np.inf, where=invalid[:, None, :])  # j >= i is no batch
        if use_slo:
            limit = _min_slo(reqs) * SLO_RTOL  # [i, j], or one number for all
            over = ws.take("over", size, len(dops), size)
            np.greater(times, limit if np.ndim(limit) == 0 else limit[:, None, :], out=over)
            np.copyto(cost, np.inf, where=over)
        dop_int = np.asarray(dops, dtype=np.int64)
        # Rows i in blocks: block [i0, i1) only needs j < i1 (skips most of j >= i).
        step = max(16, -(-size // 4))
        blocks = [(i0, min(i0 + step, size)) for i0 in range(1, size, step)]
        for k in range(1, n + 1):
            mk = int(np.searchsorted(dop_int, k, side="right"))  # dops usable with k instances
            prev = self.f[:, k - dop_int[:mk]].T  # [m, j] = f[j, k - dops[m]]
            # f(., n) is read by no later k: only f(M, n) is needed.
            for i0, i1 in blocks if k < n else [(m_req, size)]:
                cand = ws.take("cand", i1 - i0, mk, i1)
                np.add(prev[None, :, :i1], cost[i0:i1, :mk, :i1], out=cand)
                cand = cand.reshape(i1 - i0, mk * i1)
                best = np.argmin(cand, axis=1)
                self.f[i0:i1, k] = cand[np.arange(i1 - i0), best]
                self.arg_m[i0:i1, k] = dop_int[best // i1]
                self.arg_j[i0:i1, k] = best % i1

    def _fill_python(self, snap: Snapshot, n: int, dops: tuple[int, ...], use_slo: bool) -> None:
        """The same DP as :meth:`_fill_numpy`, for small problems, in plain floats."""
        reqs, news = self.reqs, self.news
        m_req = len(reqs)
        size = m_req + 1
        inf = math.inf
        f = [[inf] * (n + 1) for _ in range(size)]
        f[0][0] = 0.0
        self.f = f
        self.arg_j = [[0] * (n + 1) for _ in range(size)]
        self.arg_m = [[dops[0]] * (n + 1) for _ in range(size)]
        if m_req == 0:
            return
        lat = snap.latency
        c_new, c_np, c_sq, c_p = (float(lat.c_new), float(lat.c_new_prefix),
                                  float(lat.c_new_sq), float(lat.c_prefix))
        c_const, c_req = float(lat.c_const), float(lat.c_request)
        wp = [0.0]
        for new_i, r in zip(news, reqs):
            x, p = float(new_i), float(r.context_tokens)
            wp.append(wp[-1] + (c_new * x + c_np * x * p + c_sq * x * x + c_p * p))
        scale = slowdown(snap.cache_load)
        inv = [1.0 / lat.speedup(d) for d in dops]
        slo = [inf if r.tbt_slo_s is None else r.tbt_slo_s for r in reqs]
        # cost[i][m][j] for j < i: requests[j:i] on dops[m] instances, x its size.
        cost: list[list[list[float]]] = [[]]
        for i in range(1, size):
            per_m: list[list[float]] = [[inf] * i for _ in dops]
            limit = inf
            for j in range(i - 1, -1, -1):
                count = float(i - j)
                diff = (wp[i] - wp[j]) * scale
                fixed = (c_const + c_req * count) * scale
                if use_slo:
                    limit = min(limit, slo[j])
                lim = limit * SLO_RTOL
                for m, iv in enumerate(inv):
                    t = diff * iv + fixed
                    if not (use_slo and t > lim):
                        per_m[m][j] = t * count
            cost.append(per_m)
        arg_j, arg_m = self.arg_j, self.arg_m
        # f[j][c] is inf unless c <= j * max_dop (each batch has a request and at most
        # max_dop instances): such rows and candidates are skipped, which leaves the
        # result and the tie-breaking unchanged.
        max_dop = dops[-1]
        for k in range(1, n + 1):
            usable = [(m, d, -(-(k - d) // max_dop)) for m, d in enumerate(dops) if d <= k]
            for i in (range(1, size) if k < n else (m_req,)):
                if k > i * max_dop:
                    continue
                best, bm, bj = inf, dops[0], 0
                ci = cost[i]
                for m, d, j_lo in usable:
                    cm, col = ci[m], k - d
                    for j in range(j_lo, i):
                        v = f[j][col] + cm[j]
                        if v < best:
                            best, bm, bj = v, d, j
                f[i][k] = best
                arg_m[i][k] = bm
                arg_j[i][k] = bj

    def final(self) -> list[float]:
        """``f(M, k)`` for ``k = 0..N``."""
        return [float(x) for x in self.f[len(self.reqs)]]

    def backtrack(self, k: int) -> list[BatchDecision]:
        out = []
        i = len(self.reqs)
        while i > 0:
            j, m = int(self.arg_j[i][k]), int(self.arg_m[i][k])
            out.append(BatchDecision(tuple(r.request_id for r in self.reqs[j:i]),
                                     self.reqs[0].phase, m, tuple(self.news[j:i])))
            i, k = j, k - m
        out.reverse()
        return out


def _min_slo(reqs: list[RequestView]) -> np.ndarray | float:
    """``[i, j]`` = smallest TBT SLO among ``reqs[j:i]`` (inf where there is none); one
    number when every request has the same SLO (or none)."""
    slo = np.array([np.inf if r.tbt_slo_s is None else r.tbt_slo_s for r in reqs])
    size = len(reqs) + 1
    if (slo == slo[0]).all():  # one SLO for all (or none): no range minimum needed
        return float(slo[0])
    # a[i, j] = slo[j] for j < i, else inf; accumulate from j = i-1 down to 0.
    a = np.where(np.arange(size)[None, :] < np.arange(size)[:, None],
                 np.concatenate((slo, [np.inf]))[None, :], np.inf)
    return np.minimum.accumulate(a[:, ::-1], axis=1)[:, ::-1]


class _Workspace:
    """The DP's large arrays, kept between decisions (one per thread): a fresh array of
    a few hundred KB costs more in page faults (the allocator hands such blocks back to
    the system when freed) than the arithmetic done in it. Views of the first ``size``
    rows and columns; ``count`` and ``invalid`` depend on the position only, so their
    views are already filled."""

    def __init__(self, size: int, n_dops: int) -> None:
        self.size, self.n_dops = size, n_dops
        idx = np.arange(size, dtype=np.float64)
        self.count = idx[:, None] - idx[None, :]
        self.invalid = self.count <= 0
        self.diff = np.empty((size, size))
        self.fixed = np.empty((size, size))
        cells = size * n_dops * size
        self._flat = {"times": np.empty(cells), "cost": np.empty(cells),
                      "over": np.empty(cells, dtype=bool), "cand": np.empty(cells)}

    def take(self, name: str, rows: int, d: int, cols: int) -> np.ndarray:
        """A contiguous ``(rows, d, cols)`` view of the flat array ``name``."""
        return self._flat[name][: rows * d * cols].reshape(rows, d, cols)


_WORKSPACES = threading.local()


#: Largest ``(i, dop, j)`` tensor (cells) a thread keeps between decisions: 2M cells are
#: 16 MB per array (e.g. 500 requests at 8 DoPs); larger problems get fresh arrays.
KEEP_CELLS = 1 << 21


def _workspace(size: int, n_dops: int) -> _Workspace:
    """This thread's workspace, grown by a quarter more than asked when too small; a
    problem over :data:`KEEP_CELLS` gets arrays of its own, not kept."""
    ws = getattr(_WORKSPACES, "ws", None)
    if ws is not None and ws.size >= size and ws.n_dops >= n_dops:
        return ws
    d = max(n_dops, ws.n_dops if ws is not None else 1)
    grown = max(size + size // 4, ws.size if ws is not None else 0)
    if grown * grown * d > KEEP_CELLS:
        grown, d = size, n_dops
    ws = _Workspace(grown, d)
    if grown * grown * d <= KEEP_CELLS:
        _WORKSPACES.ws = ws
    return ws


class GoodputScheduler:
    """The paper's goodput-optimized DP scheduler (see the module docstring).

    Args:
        chunk_tokens: most new tokens one prefill request computes per iteration.
        max_prefill_dop: cap on a prefill batch's DoP (default: all free instances).
        prefill_dops: ``"all"`` (every DoP 1..N, the exact DP) or ``"pow2"`` (1, 2, 4,
            ...: the DP is exact over that restricted set and ~N/log2(N) times faster).
        decode_batches: ``"keep"`` (a running decode batch stays together on its
            instance unless the SLO asks for a change or re-forming costs less, moves
            counted: :mod:`scheduler.keep`) or ``"reform"`` (every decision batches
            every decode request afresh, the stateless DP of the paper).
    """

    name = "goodput-dp"

    def __init__(self, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 max_prefill_dop: int | None = None, prefill_dops: str = "all",
                 decode_batches: str = "keep") -> None:
        if decode_batches not in DECODE_BATCH_RULES:
            raise ValueError(f"decode_batches must be one of {DECODE_BATCH_RULES}, got {decode_batches!r}")
        self.decode_batches = decode_batches
        if prefill_dops not in ("all", "pow2"):
            raise ValueError(f"prefill_dops must be 'all' or 'pow2', got {prefill_dops!r}")
        self.prefill_dops = prefill_dops
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if max_prefill_dop is not None and max_prefill_dop < 1:
            raise ValueError(f"max_prefill_dop must be >= 1, got {max_prefill_dop}")
        self.chunk_tokens = chunk_tokens
        self.max_prefill_dop = max_prefill_dop

    def schedule(self, snap: Snapshot) -> Decision:
        return self.solve(snap).decision

    def solve(self, snap: Snapshot) -> Solution:
        """The decision plus the DP objective and whether the SLO fallback was taken."""
        n = snap.free_instances
        reqs = snap.requests
        prefill, decode = order(reqs, "prefill"), order(reqs, "decode")
        notes = []
        if n == 0 or not reqs:
            return Solution(Decision((), "no free instance" if reqs else ""), 0.0, False)
        if n == 1 and prefill and decode:
            prefill = []
            notes.append("one free instance: prefill deferred, decode only")
        max_dop = min(n, self.max_prefill_dop or n)
        dops = tuple(range(1, max_dop + 1))
        if self.prefill_dops == "pow2" or _tensor_bytes(len(prefill), len(dops)) > MAX_TENSOR_BYTES:
            if self.prefill_dops != "pow2":
                notes.append("prefill DoPs restricted to powers of two (DP memory cap)")
            dops = tuple(1 << e for e in range(max_dop.bit_length()))
        sol = self._solve(snap, prefill, decode, n, dops, use_slo=True)
        fell_back = sol is None
        if fell_back:
            sol = self._solve(snap, prefill, decode, n, dops, use_slo=False)
            notes.append("TBT SLO infeasible: fell back to throughput-first (SLO ignored)")
        batches, total = sol
        return Solution(Decision(tuple(batches), "; ".join(notes)), total, fell_back)

    def _solve(self, snap: Snapshot, prefill: list[RequestView], decode: list[RequestView],
               n: int, dops: tuple[int, ...],
               use_slo: bool) -> tuple[list[BatchDecision], float] | None:
        dp_p = _PhaseDP(snap, prefill, self.chunk_tokens, n, dops, use_slo)
        dp_d = _PhaseDP(snap, decode, self.chunk_tokens, n, (1,), use_slo)
        fp = dp_p.final()
        total, kp, kd = _split(fp, dp_d.final(), n)
        reform = None if total == math.inf else (dp_p.backtrack(kp) + dp_d.backtrack(kd), total)
        if self.decode_batches == "reform" or not any(r.decode_instance is not None for r in decode):
            return reform
        views = {r.request_id: r for r in decode}
        given_up: frozenset[int] = frozenset()
        best: tuple | None = None  # (objective with moves, plan)
        while True:
            kept = KeptDecode.of(snap, decode, use_slo, given_up)
            if not kept.groups:  # nothing kept: the stateless DP, on the old instances
                if reform is not None and (best is None or reform[1] + _moves(decode) < best[0]):
                    return placed(snap, reform[0], views), reform[1]
                break
            dp_f = _PhaseDP(snap, kept.free, self.chunk_tokens, n, (1,), use_slo)
            held = len(kept.groups)
            fk = [math.inf] * held + [kept.cost + f for f in dp_f.final()[: n + 1 - held]]
            total, kp, kd = _split(fp, fk, n)
            moved = [views[rid] for rid in views if views[rid].decode_instance in given_up]
            if total < math.inf and (best is None or total + _moves(moved) < best[0]):
                rest = placed(snap, dp_f.backtrack(kd - held), views, frozenset(kept.groups))
                best = (total + _moves(moved), (dp_p.backtrack(kp) + kept.batches() + rest, total))
            elif best is not None:
                break  # giving up one more kept batch does not pay for its moves
            # the smallest kept batch given up too (fewest moves)
            given_up |= {min(kept.groups, key=lambda i: (len(kept.groups[i]), i))}
        return None if best is None else best[1]


def _moves(moved: list[RequestView]) -> float:
    """What moving ``moved`` to other decode batches costs, in the DP objective's units:
    each waits for its new batch's instance, about one TBT SLO (1 s without one)."""
    return sum(1.0 if r.tbt_slo_s is None else r.tbt_slo_s for r in moved if r.decode_instance is not None)


def _split(fp: list[float], fd: list[float], n: int) -> tuple[float, int, int]:
    """The split ``k_p + k_d <= n`` of the instances between the phases with the least
    total ``fp[k_p] + fd[k_d]``; ties go to the smallest ``k_p``, then the smallest ``k_d``."""
    best, kp, kd = math.inf, 0, 0
    for p in range(n + 1):
        for d in range(n + 1 - p):
            t = fp[p] + fd[d]
            if t < best:
                best, kp, kd = t, p, d
    return best, kp, kd
