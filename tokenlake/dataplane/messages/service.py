"""Messages between a control-plane server and its remote clients (6x asks, 7x answers).

A process that is not the pool's driver (a serving framework's worker, a status tool)
reaches the one control plane through ``tokenlake serve``'s control port
(:mod:`tokenlake.service`). Each call of the in-process
:class:`~tokenlake.core.control.ControlPlane` has one request kind; its arguments and
results are the core's own frozen dataclasses, carried exactly by
:mod:`tokenlake.dataplane.messages.codec`. ``COMPLETE``, ``ABORT`` and
``FINISH_REQUEST`` are answered with ``ACK``; any failure with ``ERROR`` (the caller gets
the typed exception). ``docs/protocol.md`` is the spec of each body.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenlake.core.control import ControlStats
from tokenlake.core.cost_model import LatencyModel
from tokenlake.core.plans import Batch, Plans
from tokenlake.core.prefix_tree import MatchResult, SegmentLocation
from tokenlake.core.specs import HardwareProfile
from tokenlake.dataplane.messages.base import Fields, WireMessage
from tokenlake.dataplane.messages.codec import from_plain, to_plain
from tokenlake.dataplane.shm_files import BufferSpec
from tokenlake.dataplane.wire import Kind


class _PlainBody:
    """Mixin: the body is the dataclass's fields through the codec, read back by their
    annotations (no tensors). Put it before :class:`WireMessage` in the bases."""

    def body(self) -> dict:
        return to_plain(self)  # the map of its fields

    @classmethod
    def from_wire(cls, f: Fields) -> Any:
        f.tensors(0)
        kwargs = {}
        for name, tp, required in _body_fields(cls):
            if required or name in f.body:
                kwargs[name] = from_plain(tp, f.get(name), f, name)
        return cls(**kwargs)


@functools.cache
def _body_fields(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    """``(name, type, required)`` of each field of a message class (looked up once)."""
    hints = typing.get_type_hints(cls)
    return tuple((fd.name, hints[fd.name], fd.default is dataclasses.MISSING)
                 for fd in dataclasses.fields(cls))


@dataclass(frozen=True)
class CpMatch(_PlainBody, WireMessage):
    """``CP_MATCH`` ``{"tokens": [int], "max_tokens": int | None, "salt": str | None
    (optional)}``: ``get_prefix_tree().match(tokens, max_tokens, salt)`` (``salt``: the
    cache salt the prompt's segments were stored under; absent or null: none); answered
    with :class:`CpMatched`."""

    KIND = Kind.CP_MATCH
    tokens: tuple[int, ...]
    max_tokens: int | None
    salt: str | None = None


@dataclass(frozen=True)
class CpMatched(_PlainBody, WireMessage):
    """``CP_MATCHED`` ``{"match": MatchResult}``: keys, ready replicas, hit tokens."""

    KIND = Kind.CP_MATCHED
    match: MatchResult


@dataclass(frozen=True)
class CpCacheLoad(_PlainBody, WireMessage):
    """``CP_CACHE_LOAD`` ``{"reqs": [[int]], "hardware": HardwareProfile, "latency":
    LatencyModel}``: ``get_cache_load``; answered with :class:`CpLoad`."""

    KIND = Kind.CP_CACHE_LOAD
    reqs: tuple[tuple[int, ...], ...]
    hardware: HardwareProfile
    latency: LatencyModel


@dataclass(frozen=True)
class CpLoad(_PlainBody, WireMessage):
    """``CP_LOAD`` ``{"load": float}``: the share of the cluster the pool uses."""

    KIND = Kind.CP_LOAD
    load: float


@dataclass(frozen=True)
class CpGenPlans(_PlainBody, WireMessage):
    """``CP_GEN_PLANS`` ``{"batches": [Batch], "dops": [int], "homes": [int | None] | None}``:
    ``gen_plans``; answered with :class:`CpPlans`."""

    KIND = Kind.CP_GEN_PLANS
    batches: tuple[Batch, ...]
    dops: tuple[int, ...]
    homes: tuple[int | None, ...] | None


@dataclass(frozen=True)
class CpPlans(_PlainBody, WireMessage):
    """``CP_PLANS`` ``{"plans": Plans, "grants": [[bin, bin]] (optional)}``: one
    iteration's plans, in flight until ``CP_COMPLETE`` or ``CP_ABORT`` names their
    iteration; ``grants``: for a client session, the grant of each sub-batch's query
    plan and transfer plan, in plan order (:mod:`tokenlake.dataplane.grants`)."""

    KIND = Kind.CP_PLANS
    plans: Plans
    grants: tuple[tuple[bytes, bytes], ...] = ()


@dataclass(frozen=True)
class CpComplete(_PlainBody, WireMessage):
    """``CP_COMPLETE`` ``{"iteration": int}``: every put of that iteration's plans is
    stored (``complete``); answered with ``ACK``."""

    KIND = Kind.CP_COMPLETE
    iteration: int


@dataclass(frozen=True)
class CpAbort(_PlainBody, WireMessage):
    """``CP_ABORT`` ``{"iteration": int}``: undo that iteration's plans (``abort``);
    answered with ``ACK``."""

    KIND = Kind.CP_ABORT
    iteration: int


@dataclass(frozen=True)
class CpFinishRequest(_PlainBody, WireMessage):
    """``CP_FINISH_REQUEST`` ``{"request_id": str}``: ``finish_request``; answered with ``ACK``."""

    KIND = Kind.CP_FINISH_REQUEST
    request_id: str


@dataclass(frozen=True)
class CpLeasePrefix(_PlainBody, WireMessage):
    """``CP_LEASE_PREFIX`` ``{"request_id": str, "tokens": [int], "cache_salt": str |
    None (optional)}``: ``lease_prefix`` (admit the request, under that cache salt, with
    that cached prefix leased, outside any iteration); answered with :class:`CpLeased`."""

    KIND = Kind.CP_LEASE_PREFIX
    request_id: str
    tokens: tuple[int, ...]
    cache_salt: str | None = None


@dataclass(frozen=True)
class CpLeased(_PlainBody, WireMessage):
    """``CP_LEASED`` ``{"locations": [SegmentLocation], "grants": [[instance, bin]]
    (optional)}``: the replica leased for each segment of the prefix, in order (read them
    until ``CP_FINISH_REQUEST``); ``grants``: per instance, the grant to read exactly
    that instance's leased slots, in the order of ``locations``
    (:mod:`tokenlake.dataplane.grants`)."""

    KIND = Kind.CP_LEASED
    locations: tuple[SegmentLocation, ...]
    grants: tuple[tuple[int, bytes], ...] = ()


@dataclass(frozen=True)
class CpStats(_PlainBody, WireMessage):
    """``CP_STATS`` ``{}``: ``stats``; answered with :class:`CpStatsResult`."""

    KIND = Kind.CP_STATS


@dataclass(frozen=True)
class SessionInfo:
    """One session as ``tokenlake status`` lists it.

    Attributes:
        session: the server's number for it (1, 2, ...; 0 is the serving process's own).
        pid: the client's process id, as it said when it opened the session.
        label: what the client called itself (``tokenlake.connect(..., label=)``).
        age_s: seconds since it opened; idle_s: seconds since its last message.
        iterations: iterations it has in flight (planned, not completed or aborted).
        requests: its live requests (each holding leases on its prefix).
        instances: the instances it has buffers on.
    """

    session: int
    pid: int
    label: str
    age_s: float
    idle_s: float
    iterations: int
    requests: int
    instances: tuple[int, ...]


@dataclass(frozen=True)
class CpStatsResult(_PlainBody, WireMessage):
    """``CP_STATS_RESULT`` ``{"stats": ControlStats, "instances": [int], "namespace":
    str, "segment_tokens": int, "sessions": [SessionInfo], "buffers": [[name, shape]],
    "restored": [[instance, segments]]}``: the statistics, the instances, what a client
    must agree with (the namespace says the model and the KV layout; ``buffers`` the
    shapes of a client's ``q``, ``out_o``, ``out_lse`` and ``kv`` buffers), the open
    sessions, and, for a pool adopted from a control process that died, the segments
    each instance brought back (``sessions``, ``buffers`` and ``restored`` are optional:
    an older server sends none; ``restored`` is empty for a pool that started empty)."""

    KIND = Kind.CP_STATS_RESULT
    stats: ControlStats
    instances: tuple[int, ...]
    namespace: str
    segment_tokens: int
    sessions: tuple[SessionInfo, ...] = ()
    buffers: tuple[tuple[str, tuple[int, ...]], ...] = ()
    restored: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class CpClientInfo(_PlainBody, WireMessage):
    """``CP_CLIENT_INFO`` ``{"instance": int}``: what opening that instance's data-plane
    client needs; answered with :class:`CpClientInfoResult`."""

    KIND = Kind.CP_CLIENT_INFO
    instance: int


@dataclass(frozen=True)
class CpClientInfoResult(_PlainBody, WireMessage):
    """``CP_CLIENT_INFO_RESULT`` ``{"instance": int, "endpoints": [[role, endpoint]],
    "buffers": [[name, BufferSpec]], "timeout_s": float, "keys": {name: str | None} |
    None, "slab": BufferSpec | None (optional)}``: the instance's query and transfer engine
    endpoints and its client buffers (``q``, ``out_o``, ``out_lse``, ``kv``), attachable on
    the engines' machine; ``timeout_s`` is the cluster's wait limit for an engine's answer
    (seconds); ``keys`` the member's CURVE keys
    (:meth:`tokenlake.dataplane.auth.ClusterKeys.member_view`; ``None``: the cluster runs
    without CURVE); ``slab``: the instance's slab, when it is POSIX shared memory that a
    client on the pool's machine may map and read its leased slots from in place (vLLM's
    load mode; docs/security.md); absent or ``None``: not mappable (a GPU pool, an
    instance on another node), read by ``READ_SEGMENT``; ``peer_slabs`` (optional):
    ``[[instance, BufferSpec]]``, the other instances' slabs mappable the same way, so that
    a client maps them without opening its session there (vLLM's query mode attends them
    in place). Sent only over the control port, which is itself CURVE-protected when the
    cluster is."""

    KIND = Kind.CP_CLIENT_INFO_RESULT
    instance: int
    endpoints: Mapping[str, str]
    buffers: Mapping[str, BufferSpec]
    timeout_s: float
    keys: Mapping[str, str | None] | None
    slab: BufferSpec | None = None
    peer_slabs: tuple[tuple[int, BufferSpec], ...] = ()
