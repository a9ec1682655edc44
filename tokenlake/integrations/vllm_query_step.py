"""One step of the query mode's worker side (:mod:`tokenlake.integrations.vllm_query`):
the step's plans registered with the home instance's engines, vLLM's rows mapped to the
plan's rows, and each attention layer's new K/V put into the pool and its q attended
over the pooled prefix, by the pool's query engine or, on the pool's machine, in place
(docs/vllm.md "Attending in place"), then merged with the new tokens' own attention."""

from __future__ import annotations

import logging
from typing import Any

import torch

from tokenlake.core.errors import EngineUnavailable
from tokenlake.dataplane.attend_layout import AttendLayout
from tokenlake.engines.compute import COALESCE_PUT_ROWS
from tokenlake.integrations.vllm_meta import QueryStep
from tokenlake.integrations.vllm_slabs import SlabMaps
from tokenlake.kernels.attention import merge
from tokenlake.kernels.cpu import merge_single_token, partial_attention

log = logging.getLogger(__name__)


class StepState:
    """Worker-side state of one step: the plans registered with the home instance's
    engines, the row mapping, the puts in flight, whether anything failed."""

    def __init__(self, step: QueryStep, client: Any | None, block_size: int, timeout_s: float,
                 slabs: SlabMaps | None = None) -> None:
        self.step = step
        self.client = client
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.failed = False
        self.ready = False  # the plans are registered: the pool can be used
        self.q_buf = self.kv_buf = None
        self.layout: AttendLayout | None = None  # in place: the plan's items, attended here
        self.in_place: list[torch.Tensor] = []  # ... over these mapped slabs (layout.insts')
        self.read_in_place = False  # some layer's output came from slots read in place
        self.plan_rows = 0
        self.spans = {}
        self.queried_rows = 0
        self.coalesced = False  # decode layers written whose put is not posted yet
        self._maps: dict[int, tuple] = {}
        if client is None and step.plans is not None:  # its instance could not be reached
            self.fail(EngineUnavailable("the pool instance's engines could not be reached"))
        if client is not None and step.plans is not None:
            (qp,), (tp,) = step.plans.query_plans, step.plans.transfer_plans
            self.spans = {s.request_id: s for s in qp.spans}
            self.plan_rows = qp.num_rows
            try:
                # registered without waiting: the first query or put reads the replies
                in_place = self._map_in_place(qp, slabs)  # then only the puts go to the engines
                self.q_buf, self.kv_buf = client.init_plans(None if in_place else qp, tp, wait=False)
                self.ready = True
            except Exception as e:  # the step runs without the pool; reported after it
                self.fail(e)

    def _map_in_place(self, plan, slabs: SlabMaps | None) -> bool:
        """Whether this step attends the plan's slots in place: every instance the plan
        reads has its slab mapped in this process (docs/vllm.md "Attending in place")."""
        if slabs is None:
            return False
        by_instance = plan.tasks_by_instance()
        try:
            mapped = [slabs.get(inst) for inst in by_instance]
        except Exception as e:  # the server could not say (an instance's engines down):
            log.info("query mode: attending by the query engine this step (%s)", e)  # ask them
            return False
        if any(slab is None for slab in mapped):
            return False
        self.layout, self.in_place = AttendLayout.of(by_instance), mapped
        return True

    def finish(self) -> None:
        """After the forward pass: the coalesced put if the last layer did not post it,
        then every put stored."""
        if self.coalesced:
            self.client.put(0, self.kv_buf.shape[0])
        self.client.wait_puts(self.timeout_s)

    def fail(self, error: BaseException) -> None:
        if not self.failed:
            log.warning("query mode: this step could not use the pool (%s); its requests "
                        "with pooled tokens are computed again", error)
        self.failed = True

    def mapping(self, attn_metadata) -> tuple:
        """``(own, vllm_rows, plan_rows, complete)`` for this step's batch: ``own`` the
        ``(start, stop)`` token ranges of the planned requests in vLLM's batch, the rows
        that take their vLLM rows to the plan's rows (slices where the rows run in order,
        as for one request: views instead of gathers), and whether every request of the
        batch is planned (else vLLM attends over its own blocks for the others)."""
        key = id(attn_metadata)
        if key not in self._maps:
            qsl = attn_metadata.query_start_loc.tolist()
            slots = attn_metadata.slot_mapping
            own, dst, complete = [], [], True
            for j in range(len(qsl) - 1):
                start, stop = qsl[j], qsl[j + 1]
                if stop <= start:
                    continue
                rid = self.step.anchors.get(int(slots[start]) // self.block_size)
                span = self.spans.get(rid)
                if span is not None and span.stop - span.start != stop - start:
                    self.fail(RuntimeError(f"request {rid}: {stop - start} new tokens in "
                                           f"vLLM's batch, {span.stop - span.start} planned"))
                    span = None
                if span is None:  # attended by vLLM itself (or computed again)
                    complete = False
                    continue
                own.append((start, stop))
                dst.append((span.start, span.stop))
            self._maps = {key: (own, _rows(own), _rows(dst), complete)}
        return self._maps[key]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_metadata, scale: float) -> tuple[slice | torch.Tensor, torch.Tensor, bool] | None:
        """This layer's attention for the planned requests: the pool's partial over each
        one's earlier tokens merged with causal attention over its new ones (the new K/V
        is put first; a prompt chunk's own attention overlaps the query, a decode
        token's is merged with the answer in one pass). Returns ``(rows, out,
        complete)``: vLLM's rows (a slice or an index), their outputs (float32 for decode
        tokens, else q's dtype), and whether they are all of the batch; None when the pool
        is not used (nothing planned, or it failed)."""
        own, src, dst, complete = self.mapping(attn_metadata)
        if self.failed or not self.ready or not own:
            return None
        rows = sum(b - a for a, b in own)
        try:
            kv = self.kv_buf[layer]
            kv[dst, 0] = k[src].to(kv.dtype)
            kv[dst, 1] = v[src].to(kv.dtype)
            if rows > COALESCE_PUT_ROWS:
                self.client.put(layer)
            elif layer == self.kv_buf.shape[0] - 1:  # a few rows (decode): every layer in one
                self.client.put(0, layer + 1)  # put, beside the last layer's query
                self.coalesced = False
            else:
                self.coalesced = True  # until the last layer is written (else finish puts)
            if self.q_buf is None:  # in place: q rows of the plan's own, in this process
                self.q_buf = torch.empty((self.plan_rows, *q.shape[1:]), dtype=torch.float32)
            self.q_buf[dst] = q[src].float()
            handle = None if self.layout is not None else self.client.query_async(layer)
        except Exception as e:
            self.fail(e)
            return None
        decode = rows == len(own)  # one new token each: it attends to itself
        if not decode:
            local = [(slice(a, b), partial_attention(q[a:b], k[a:b], v[a:b], scale, causal=True))
                     for a, b in own]
        try:
            if handle is None:  # the plan's slots, read where they lie
                self.read_in_place = True
                po, plse = self.layout.attend(self.q_buf, layer, self.in_place, q.shape[1])
            else:
                po, plse = handle.wait(self.timeout_s)
            po, plse = po[dst], plse[dst]
        except Exception as e:
            self.fail(e)
            return None
        self.queried_rows += rows
        if decode:
            return src, merge_single_token(po, plse, q[src], k[src], v[src], scale), complete
        pre_o = torch.zeros_like(q, dtype=torch.float32)
        pre_lse = torch.full(q.shape[:2], float("-inf"))
        pre_o[src], pre_lse[src] = po, plse
        out = torch.empty_like(q)
        for sl, (o, lse) in local:
            out[sl] = merge(pre_o[sl], pre_lse[sl], o, lse).o.to(q.dtype)
        return src, out[src], complete


def _rows(spans: list[tuple[int, int]]) -> slice | torch.Tensor:
    """The rows of ``spans`` in order: one slice if they are consecutive, else an index."""
    if all(a == z for (_, z), (a, _) in zip(spans, spans[1:])):
        return slice(spans[0][0], spans[-1][1]) if spans else slice(0, 0)
    return torch.cat([torch.arange(a, z) for a, z in spans])
