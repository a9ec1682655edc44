"""What the serving loop does when an instance fails (:class:`Recovery`, a part of
:class:`~tokenlake.generation.loop.GenerationLoop`): the requests that lost KV are
computed again, the instance is replaced."""

from __future__ import annotations


class Recovery:
    """:meth:`preempt` and :meth:`recover` of the serving loop (its ``tracker``,
    ``control``, ``cluster`` and ``_tier_reads``)."""

    def preempt(self, request_id: str) -> bool:
        """Computes an admitted request again from the start (its KV was lost: an
        instance that held part of it failed). Between iterations only. Its leases and
        tail go back to the pool; it waits again, in its place, with its prompt plus the
        tokens it already generated as the prompt to prefill, whose last position gives
        the next token: greedy outputs stay those of an uninterrupted run, and a sampled
        request keeps its generator. Returns False if it is not admitted."""
        live = self.tracker.get(request_id)
        if live is None or not live.admitted or live.result.done:
            return False
        if request_id in self.control.live_requests:
            self.control.finish_request(request_id)
        live.prompt = live.req.prompt_ids + tuple(live.result.output_ids)
        live.preemptions += 1
        self.tracker.preempt(live, len(live.prompt))
        return True

    def recover(self) -> tuple[str, ...]:
        """Replaces the cluster's failed instances (``cluster.replace_failed``: out of
        the ring and the tree, started again empty) and preempts the requests that lost
        KV on them; returns those. Call it between iterations (no plans in flight): the
        serving service does when an engine dies and after a failed iteration."""
        replace = getattr(self.cluster, "replace_failed", None)
        if replace is None:
            return ()
        self._tier_reads.drain()  # none may reach a replaced instance's new engine
        lost = replace()
        return tuple(rid for rid in lost if self.preempt(rid))
