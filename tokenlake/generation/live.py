"""What the serving loop keeps of a request while it lives (:class:`Live`), how it
joins the policy's batches for one engine that computes them in turn
(:func:`one_per_phase`), and how it plans an iteration around requests that must wait
for another client or match again (:func:`plan_without_waiting`, :func:`take_out`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from scheduler.api import BatchDecision
from tokenlake.core.errors import PrefixNotCached, SegmentInFlight
from tokenlake.core.plans import Batch, Plans
from tokenlake.generation.requests import GenerationRequest, RequestResult
from tokenlake.generation.tracker import TrackedRequest


def one_per_phase(batches: Sequence[BatchDecision]) -> list[BatchDecision]:
    """``batches`` with the DoP 1 batches of each phase joined into one (at the first's
    place, requests in the policy's order): for one engine that computes them in turn."""
    out: list[BatchDecision] = []
    first: dict[str, int] = {}
    for b in batches:
        at = first.get(b.phase) if b.dop == 1 else None
        if at is None:
            if b.dop == 1:
                first[b.phase] = len(out)
            out.append(b)
        else:
            prev = out[at]
            out[at] = BatchDecision(prev.request_ids + b.request_ids, b.phase, 1,
                                    prev.new_tokens + b.new_tokens)
    return out


class Live(TrackedRequest):
    """A request's progress (tracked) plus what the server keeps of it."""

    __slots__ = ("req", "result", "generator", "prompt", "preemptions", "lost_hit")

    def __init__(self, req: GenerationRequest, result: RequestResult, arrival_s: float,
                 tbt_slo_s: float | None) -> None:
        super().__init__(req.request_id, len(req.prompt_ids), arrival_s, tbt_slo_s)
        self.req, self.result = req, result
        self.generator = req.sampling.generator()
        # what the next prefill computes: the prompt, plus the outputs after a preemption
        self.prompt: tuple[int, ...] = req.prompt_ids
        self.preemptions = 0
        self.lost_hit = False  # its matched prefix went before it was admitted: no hit


def plan_without_waiting(control, batches: list[Batch], dops: list[int],
                         defer: Callable[[set[str], bool], None],
                         homes: list[int | None] | None = None, promoting: list = ()) -> Plans | None:
    """``control.gen_plans(batches, dops, homes)``; a request whose new tokens complete a segment
    another client is still storing (``SegmentInFlight``) waits: ``defer`` takes it out of
    this iteration (its admission, if new, back) and the rest is planned without it
    (``batches`` and ``dops`` are changed in place). The next iteration matches it
    again, so it reuses the segment once stored, or stores it itself if that client's
    iteration was aborted (its session ended). So does a new request whose matched prefix
    is no longer cached (``PrefixNotCached``: another client's placement evicted it since
    the match). None when every request waits. ``promoting``: as ``gen_plans``'s."""
    while True:
        try:
            if promoting:  # promotions read layer by layer that these plans may attend
                return control.gen_plans(batches, dops, homes, promoting=promoting)
            return control.gen_plans(batches, dops, homes)
        except (SegmentInFlight, PrefixNotCached) as e:
            waiting = set(e.request_ids)
            if not waiting & {r.request_id for b in batches for r in b.requests}:
                raise  # names none of this iteration's requests: nothing to take out
            defer(waiting, isinstance(e, PrefixNotCached))
            pinned = homes if homes is not None else [None] * len(batches)
            kept = [(Batch(tuple(r for r in b.requests if r.request_id not in waiting), b.phase), d, h)
                    for b, d, h in zip(batches, dops, pinned)]
            kept = [(b, d, h) for b, d, h in kept if b.requests]
            if not kept:
                return None
            batches[:], dops[:] = [b for b, _, _ in kept], [d for _, d, _ in kept]
            if homes is not None:
                homes[:] = [h for _, _, h in kept]


def take_out(tracker, admitted_now: list[Live], request_ids: set[str], prefilling: dict[str, int],
             lost: bool = False) -> None:
    """Takes ``request_ids`` out of this iteration (before its plans exist): the new ones
    back to waiting (with ``lost``, admitted without a hit next time: what they matched
    went, and a request must not wait on a match that keeps failing), a later chunk's
    count undone."""
    for live in [a for a in admitted_now if a.req.request_id in request_ids]:
        admitted_now.remove(live)
        tracker.requeue(live)
        live.lost_hit |= lost
        counted = prefilling.pop(live.req.request_id, 0)
        if not live.preemptions:
            live.result.hit_tokens = live.result.prefill_tokens = 0
        else:  # a preempted one computes again: only this chunk's count is undone
            live.result.prefill_tokens -= counted
    for rid in request_ids & prefilling.keys():  # a later chunk: undo its count only
        tracker[rid].result.prefill_tokens -= prefilling.pop(rid)
