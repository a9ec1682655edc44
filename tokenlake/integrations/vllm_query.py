"""The query mode of :mod:`tokenlake.integrations.vllm`: vLLM's attention over the pooled
prefix computed in the pool, as TokenLake's own engines do it.

In the connector's load mode the pool is a store of vLLM's pages, copied into vLLM's
blocks before the forward pass. In the query mode (``"mode": "query"`` in the
connector's extra config, a pool served with ``--kv-layout hf``) nothing is copied back:
vLLM keeps no KV of its own, every token's K/V goes to the pool (``put``, layer by layer,
as each attention layer runs) and each attention layer sends its q rows to the pool
(``query``), which attends over the request's earlier tokens where their segments live
and merges the partials; vLLM's side attends over this step's new tokens only, and the
two partial results are merged exactly by log-sum-exp.

vLLM (0.32, CPU) always picks its ``CPU_ATTN`` backend, and lets an out-of-tree package
replace a backend's class (``register_backend`` in
``vllm/v1/attention/backends/registry.py``). :func:`tokenlake.integrations.vllm_plugin.register`
does that from a ``vllm.general_plugins`` entry point (declared in ``pyproject.toml``),
which vLLM runs in every process it starts; :class:`TokenLakeAttentionImpl` is ``CPU_ATTN``'s own
implementation, unchanged, unless the engine's KV-transfer config names the TokenLake
connector in query mode.

Which rows are whose: vLLM orders a step's requests its own way; the connector's
scheduler side names, for each request it planned, the vLLM block that holds the
request's first new token (``QueryStep.anchors``), and the worker reads that block from
the slot mapping of each request's first token. A block holding a not yet computed token
belongs to one request (vLLM shares only full, cached blocks, and the query mode runs with
vLLM's own prefix cache off).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from tokenlake.core.plans import Plans
from tokenlake.dataplane.attention import merge
from tokenlake.dataplane.attention_cpu import partial_attention, single_token_attention
from tokenlake.model.compute import COALESCE_PUT_ROWS

log = logging.getLogger(__name__)

CONNECTOR = "TokenLakeConnector"


@dataclass
class QueryStep:
    """The scheduler's plan of one step in query mode: ``plans`` (one sub-batch at the
    connector's instance; None when nothing goes through the pool this step),
    ``anchors`` (vLLM block of a request's first new token -> request id),
    ``first_block`` (request id -> its first vLLM block: what a failed step reports as a
    load error, so vLLM computes the request again) and ``external`` (the requests with a
    pooled prefix that vLLM's blocks do not hold: only these need computing again)."""

    plans: Plans | None
    anchors: dict[int, str] = field(default_factory=dict)
    first_block: dict[str, int] = field(default_factory=dict)
    external: frozenset[str] = frozenset()  # requests with pooled tokens vLLM never computed


@dataclass
class FailedRequests(KVConnectorWorkerMetadata):
    """Worker -> scheduler: requests whose step did not reach the pool (the scheduler
    releases them in the pool; vLLM computes them again)."""

    request_ids: frozenset[str] = frozenset()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, FailedRequests)
        return FailedRequests(self.request_ids | other.request_ids)


class StepState:
    """Worker-side state of one step: the plans registered with the home instance's
    engines, the row mapping, the puts in flight, whether anything failed."""

    def __init__(self, step: QueryStep, client: Any | None, block_size: int, timeout_s: float) -> None:
        self.step = step
        self.client = client
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.failed = client is None and step.plans is not None
        self.q_buf = self.kv_buf = None
        self.spans = {}
        self.queried_rows = 0
        self.coalesced = False  # layers whose put waits for finish()
        self.wait_s = 0.0
        self._maps: dict[int, tuple] = {}
        if client is not None and step.plans is not None:
            (qp,), (tp,) = step.plans.query_plans, step.plans.transfer_plans
            self.spans = {s.request_id: s for s in qp.spans}
            try:
                self.q_buf = client.init_query(qp)
                self.kv_buf = client.init_transfer(tp)
            except Exception as e:  # the step runs without the pool; reported after it
                self.fail(e)

    def finish(self) -> None:
        """After the forward pass: the coalesced put, then every put stored."""
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
        ``(start, stop)`` token ranges of the planned requests in vLLM's batch, the index
        tensors that take their vLLM rows to the plan's rows, and whether every request of
        the batch is planned (else vLLM attends over its own blocks for the others)."""
        key = id(attn_metadata)
        if key not in self._maps:
            qsl = attn_metadata.query_start_loc.tolist()
            slots = attn_metadata.slot_mapping
            own, src, dst, complete = [], [], [], True
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
                src.append(torch.arange(start, stop))
                dst.append(torch.arange(span.start, span.stop))
            self._maps = {key: (own, _cat(src), _cat(dst), complete)}
        return self._maps[key]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_metadata, scale: float) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """This layer's attention for the planned requests: the pool's partial over each
        one's earlier tokens merged with causal attention over its new ones (the new K/V
        is put first; the query overlaps the local attention). Returns ``(rows, out,
        complete)``: vLLM's row indices, their outputs, and whether they are all of the
        batch; None when the pool is not used (nothing planned, or it failed)."""
        own, src, dst, complete = self.mapping(attn_metadata)
        if self.failed or self.q_buf is None or len(src) == 0:
            return None
        try:
            self.kv_buf[layer, dst] = torch.stack((k[src], v[src]), dim=1).float()
            if len(src) > COALESCE_PUT_ROWS:
                self.client.put(layer)
            else:  # a few rows (decode): one put of every layer after the pass (finish)
                self.coalesced = True
            self.q_buf[dst] = q[src].float()
            handle = self.client.query_async(layer)
        except Exception as e:
            self.fail(e)
            return None
        if all(b - a == 1 for a, b in own):  # decode: each row attends to its own token
            local = [(src, single_token_attention(q[src], k[src], v[src], scale))]
        else:
            local = [(torch.arange(a, b), partial_attention(q[a:b], k[a:b], v[a:b], scale,
                                                            causal=True)) for a, b in own]
        t0 = time.perf_counter()
        try:
            part = handle.wait(self.timeout_s)
            pre_o = torch.zeros_like(q, dtype=torch.float32)
            pre_lse = torch.full(q.shape[:2], float("-inf"))
            pre_o[src] = part.o[dst]
            pre_lse[src] = part.lse[dst]
        except Exception as e:
            self.fail(e)
            return None
        finally:
            self.wait_s += time.perf_counter() - t0
        self.queried_rows += len(src)
        out = torch.empty_like(q)
        for rows, (o, lse) in local:
            out[rows] = merge(pre_o[rows], pre_lse[rows], o, lse).o.to(q.dtype)
        return src, out[src], complete


def _cat(index: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(index) if index else torch.empty(0, dtype=torch.long)


def query_mode_configured(vllm_config) -> bool:
    """Whether ``vllm_config`` runs the TokenLake connector in query mode."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None or getattr(kv, "kv_connector", None) != CONNECTOR:
        return False
    return (kv.kv_connector_extra_config or {}).get("mode", "load") == "query"


class TokenLakeAttentionImpl(CPUAttentionBackendImpl):
    """``CPU_ATTN``'s implementation, with the pooled prefix attended through TokenLake
    when the connector runs in query mode (decoder self-attention only)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from vllm.config import get_current_vllm_config
        from vllm.v1.attention.backend import AttentionType

        self.tokenlake_query = (query_mode_configured(get_current_vllm_config())
                                and self.attn_type == AttentionType.DECODER)
        if self.tokenlake_query:
            self._check_query_mode()

    def _check_query_mode(self) -> None:
        """The pool's query engines compute plain softmax attention with scale
        ``1/sqrt(head_dim)``; refuse a layer that needs anything else."""
        from tokenlake.core.errors import ConfigError

        unsupported = {
            "a sliding window": self.sliding_window not in (None, -1),
            "ALiBi": self.alibi_slopes is not None,
            "a logits soft cap": bool(self.logits_soft_cap),
            "attention sinks": self.sinks is not None,
            "an FP8 KV cache": self.is_fp8_kv_cache,
            f"the softmax scale {self.scale} (the pool uses 1/sqrt({self.head_size}))":
                abs(self.scale - self.head_size ** -0.5) > 1e-6 * self.scale,
        }
        bad = [what for what, yes in unsupported.items() if yes]
        if bad:
            raise ConfigError(f"the query mode cannot serve a layer with {', '.join(bad)}")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if not self.tokenlake_query or attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        n = attn_metadata.num_actual_tokens
        pooled = get_kv_transfer_group().attend(layer.layer_name, query[:n], key[:n], value[:n],
                                                attn_metadata, self.scale)
        if pooled is None or not pooled[2]:
            # requests the pool does not serve this step: vLLM's own attention over its
            # blocks (right for every request whose tokens this instance computed itself)
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                            output_scale, output_block_scale)
        if pooled is not None:
            rows, out, _ = pooled
            output[rows] = out.reshape(len(rows), *output.shape[1:]).to(output.dtype)
        return output


class TokenLakeAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with :class:`TokenLakeAttentionImpl` (same name, metadata, cache)."""

    @staticmethod
    def get_impl_cls() -> type[TokenLakeAttentionImpl]:
        return TokenLakeAttentionImpl
