"""What the TokenLake connector's scheduler side sends its worker side each step
(:class:`TokenLakeMetadata`) and back (:class:`FailedRequests`), for both modes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from tokenlake.core.errors import ConfigError
from tokenlake.core.plans import Plans

_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class Load:
    """Blocks of one request to fill from the pool: per segment, its ``(instance, slot)``
    and the vLLM block ids it fills (the blocks vLLM computed itself are left alone:
    ``skip`` leading blocks of the first segment)."""

    request_id: str
    segments: list[tuple[int, int]]
    blocks: list[list[int]]
    skip: int = 0
    grants: tuple[tuple[int, bytes], ...] = ()  # (instance, the lease's read grant there)


@dataclass
class Store:
    """This step's plan for storing completed segments: ``rows`` lists, in the plan's
    row order, each request's block ids whose pages fill its rows."""

    plans: Plans
    rows: list[tuple[str, list[int]]]
    grants: tuple[tuple[bytes, bytes], ...] = ()  # the server's grants of the plans (the session's)


@dataclass
class QueryStep:
    """The scheduler's plan of one step in query mode: ``plans`` (one sub-batch at the
    connector's instance; None when nothing goes through the pool this step),
    ``anchors`` (vLLM block of a request's first new token -> request id),
    ``first_block`` (request id -> its first vLLM block: what a failed step reports as a
    load error, so vLLM computes the request again), ``external`` (the requests with a
    pooled prefix that vLLM's blocks do not hold: only these need computing again after a
    step that failed in the pool) and ``last_block`` (request id -> the vLLM block of its
    last token before this step, for one that has any: what a step attended in place that
    failed reports, so vLLM discards the step's output and computes it again)."""

    plans: Plans | None
    anchors: dict[int, str] = field(default_factory=dict)
    first_block: dict[str, int] = field(default_factory=dict)
    external: frozenset[str] = frozenset()  # requests with pooled tokens vLLM never computed
    grants: tuple[tuple[bytes, bytes], ...] = ()  # the server's grants of the plans (the session's)
    last_block: dict[str, int] = field(default_factory=dict)


@dataclass
class TokenLakeMetadata(KVConnectorMetadata):
    """One step's work for the worker side: loads (load mode), blocks vLLM must compute,
    the store plan (load mode) or the query plan (query mode)."""

    loads: list[Load] = field(default_factory=list)
    failed_blocks: list[int] = field(default_factory=list)  # loads refused by the pool
    store: Store | None = None
    query: QueryStep | None = None  # query mode: this step's plan


@dataclass
class FailedRequests(KVConnectorWorkerMetadata):
    """Worker -> scheduler: requests whose step did not reach the pool (the scheduler
    releases them in the pool; vLLM computes them again)."""

    request_ids: frozenset[str] = frozenset()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, FailedRequests)
        return FailedRequests(self.request_ids | other.request_ids)


def layer_index(layer_name: str) -> int:
    m = _LAYER.search(layer_name)
    if m is None:
        raise ConfigError(f"cannot tell the layer of {layer_name!r}")
    return int(m.group(1))

