"""How the sub-batches of one sequence-parallel batch see each other's new KV.

A batch of DoP ``d`` is split into ``d`` sub-batches of contiguous rows (docs/design.md
§5), each computed by the compute engine of its own instance. A request whose new
tokens cross a split has rows in several sub-batches; the rows of a later sub-batch
attend to three things: the request's prefix in the pool (the query plan), the
request's rows in the earlier sub-batches, and their own rows (causal). The second
part moves between compute engines, layer by layer, as K/V (*pass-KV*):

* after computing layer ``l``, a sub-batch whose last request continues in the next
  sub-batch publishes that request's K/V rows of layer ``l``;
* a sub-batch whose first request started in an earlier sub-batch collects those rows
  (from the previous sub-batches, nearest last) before it finishes layer ``l``'s
  attention.

Why K/V and not the query rows (the paper's pass-Q, §3.3): with grouped-query
attention a row's K/V (``2 * kv_heads * head_dim`` numbers) is smaller than its query
plus the partial result sent back (``2 * q_heads * head_dim + q_heads``): 3x smaller for
SmolLM2 (9 query heads, 3 KV heads), 2x for Llama-3-8B. A sub-batch needs only the
earlier rows of at most one request (its first), which it receives once and attends
itself, and nothing waits for the pool's transfer engines to have stored them.

:class:`LocalExchange` serves sub-batches computed in one process (threads of
:class:`~tokenlake.engines.compute.ParallelComputeEngine`, or one after the other); the
Ray compute actors pass the rows by actor calls (``tokenlake.deploy.ray``) into the
same kind of mailbox.
"""

from __future__ import annotations

import threading
import time

import torch

from tokenlake.core.errors import EngineUnavailable, PlanError

#: (batch, part, layer) -> (request id, k, v): one sub-batch's published rows.
Key = tuple[int, int, int]


class _Waited(EngineUnavailable):
    """A sub-batch gave up waiting because another one failed (not a cause itself)."""


class LocalExchange:
    """A mailbox of published K/V rows, for one iteration.

    ``publish`` files a sub-batch's rows; ``collect`` blocks until the rows it needs
    are filed (at most ``timeout_s``), or until :meth:`fail` says a sub-batch of the
    iteration failed (then it raises at once instead of waiting out the timeout).
    """

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._rows: dict[Key, tuple[str, torch.Tensor, torch.Tensor]] = {}
        self._cond = threading.Condition()
        self._error: BaseException | None = None

    def publish(self, batch: int, part: int, layer: int, request_id: str,
                k: torch.Tensor, v: torch.Tensor) -> None:
        """Files rows ``k``, ``v`` ``[rows, kv_heads, head_dim]`` of ``request_id``, the
        last request of sub-batch ``(batch, part)``, for ``layer``."""
        with self._cond:
            self._rows[(batch, part, layer)] = (request_id, k, v)
            self._cond.notify_all()

    @property
    def error(self) -> BaseException | None:
        """The first failure :meth:`fail` was told of (None: none)."""
        return self._error

    def fail(self, exc: BaseException) -> None:
        """A sub-batch of this iteration failed: every waiting ``collect`` raises."""
        with self._cond:
            if self._error is None and not isinstance(exc, _Waited):
                self._error = exc
            self._cond.notify_all()

    def _take(self, key: Key) -> tuple[str, torch.Tensor, torch.Tensor]:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while key not in self._rows:
                if self._error is not None:
                    raise _Waited(f"sub-batch {key[0]}:{key[1]} has no layer {key[2]} "
                                            f"rows: another sub-batch failed ({self._error})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineUnavailable(f"sub-batch {key[0]}:{key[1]} did not publish layer "
                                            f"{key[2]} within {self.timeout_s:.0f} s")
                self._cond.wait(left)
            return self._rows[key]

    def collect(self, batch: int, part: int, layer: int, request_id: str,
                rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last ``rows`` rows of ``request_id`` before sub-batch ``(batch, part)``, in
        sequence order, as ``(k, v)``: gathered from parts ``part - 1``, ``part - 2``, ...
        A plan whose earlier sub-batches do not end with those rows is a ``PlanError``."""
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        got, p = 0, part - 1
        while got < rows:
            if p < 0:
                raise PlanError(f"request {request_id!r} needs {rows} rows before sub-batch "
                                f"{batch}:{part}; the earlier sub-batches have {got}")
            rid, k, v = self._take((batch, p, layer))
            if rid != request_id:
                raise PlanError(f"sub-batch {batch}:{p} ends with request {rid!r}, not {request_id!r}")
            ks.append(k)
            vs.append(v)
            got += k.shape[0]
            p -= 1
        if got != rows:
            raise PlanError(f"request {request_id!r}: {got} rows before sub-batch {batch}:{part}, expected {rows}")
        if len(ks) == 1:
            return ks[0], vs[0]
        return torch.cat(ks[::-1]), torch.cat(vs[::-1])
