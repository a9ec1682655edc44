"""Tests of the typed wire messages (tokenlake/dataplane/messages, docs/protocol.md).

Every kind has one message class; each round-trips through the wire; each refuses a
malformed body with a WireError that names the kind and the field; peer kinds are never
taken for client kinds (nothing is told apart by which keys a body has); plan items are
built from the control plane's plans once and arrive typed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_util import SERVICE_EXAMPLES

from tokenlake.core.errors import CapacityError, PlanError
from tokenlake.core.plans import PageCopy, PutItem, QueryItem, QueryPlan, QueryTask, TransferPlan
from tokenlake.dataplane import messages as m
from tokenlake.dataplane import wire
from tokenlake.dataplane.shm_files import BufferSpec
from tokenlake.dataplane.tensor_frames import WireError
from tokenlake.dataplane.wire import Kind

Q = torch.randn(3, 4, 8)
LSE = torch.randn(3, 4)
KV = torch.randn(2, 2, 2, 8)
SEG = torch.randn(2, 2, 2, 4, 8)

#: One message of every kind, with nested items and tensors where the kind has them.
EXAMPLES: dict[Kind, m.WireMessage] = {
    Kind.PING: m.Ping(),
    Kind.PONG: m.Pong("query", 1, 64, 1, 10, 0.25),
    Kind.ERROR: m.ErrorReply("SegmentInFlight", "stored by another iteration", ("r1", "r2")),
    Kind.ACK: m.Ack(),
    Kind.RELEASE_PLAN: m.ReleasePlan(7),
    Kind.PLAN_ACK: m.PlanAck(7),
    Kind.REGISTER_QUERY_PLAN: m.RegisterQueryPlan(7, 5, (
        m.InstanceItems(0, (m.AttendItem(0, 2, (1, 4), (8, 3)),)),
        m.InstanceItems(2, (m.AttendItem(2, 5, (0,), (8,)), m.AttendItem(3, 5, (6,), (2,)))),
    ), b"g" * 32),
    Kind.QUERY: m.Query(7, 1),
    Kind.QUERY_DONE: m.QueryDone(1),
    Kind.REGISTER_TRANSFER_PLAN: m.RegisterTransferPlan(8, 4, (
        m.PutTarget(0, 3, 0, 0, 2), m.PutTarget(1, 9, 5, 2, 4)), (m.SlotCopy(1, 4, 1, 9, 5),), b"h" * 32),
    Kind.PUT: m.Put(8, 0, 2),
    Kind.PUT_DONE: m.PutDone(0),
    Kind.COPY_SEGMENT: m.CopySegment(3, 1, 11),
    Kind.COPY_DONE: m.CopyDone(11),
    Kind.READ_SEGMENT: m.ReadSegment(1, (2, 5), b"r" * 32),
    Kind.SEGMENT_DATA: m.SegmentData(1, (2, 5), (SEG[0], SEG[1])),
    Kind.SHUTDOWN: m.Shutdown(),
    Kind.PEERS: m.Peers(((1, "tcp://127.0.0.1:5555"), (2, None))),
    Kind.OPEN_SESSION: m.OpenSession(b"S" + b"t" * 15, {"kv": BufferSpec("tokenlake-1-ab-s3-kv-0", (2, 8, 2, 2, 4), "bfloat16")}),
    Kind.CLOSE_SESSION: m.CloseSession(b"S" + b"t" * 15),
    Kind.ADOPT: m.Adopt(4242, b"g" * 32),
    Kind.RETIRE: m.Retire(b"S" + b"t" * 15, (14, 3)),
    Kind.PEER_REGISTER_PLAN: m.PeerRegisterPlan(0, 7, (m.AttendItem(0, 3, (0,), (8,)),)),
    Kind.PEER_RELEASE_PLAN: m.PeerReleasePlan(0, 7),
    Kind.PEER_QUERY: m.PeerQuery(0, 7, 1, Q),
    Kind.PEER_QUERY_RESULT: m.PeerQueryResult(1, Q, LSE),
    Kind.PEER_PUT: m.PeerPut(0, 2, (m.SlotWrite(9, 5, 2),), (KV[0], KV[1]), (m.SlotCopy(1, 4, 2, 9, 5),)),
    Kind.PEER_SEGMENT: m.PeerSegment(11, SEG),
    Kind.TIER_OPS: m.TierOps((b"d" * 16,), ((3, m.TierEntry(b"k" * 16, None, 0, b"\x01\x00\x00\x00")),
                                             (4, m.TierEntry(b"c" * 16, b"k" * 16, 1, None))), 2),
    Kind.TIER_READ: m.TierRead(((b"k" * 16, 3, -1), (b"c" * 16, 4, 2)), 3, True),
    Kind.TIER_PROGRESS: m.TierProgress(7),
    Kind.TIER_DONE: m.TierDone((b"k" * 16,), (b"c" * 16,), {"written": 3.0, "paced_s": 0.25}),
    Kind.TIER_LIST: m.TierList(),
    Kind.TIER_LISTING: m.TierListing((m.TierEntry(b"k" * 16, None, 0, b"\x01\x00\x00\x00"),)),
    **SERVICE_EXAMPLES,  # the control-plane server's kinds (CP_*)
}

PEER_KINDS = {k for k in Kind if k.name.startswith("PEER_")}


def round_trip(message: m.WireMessage, msg_id: int = 42) -> m.WireMessage:
    got_id, got = m.decode(message.encode(msg_id))
    assert got_id == msg_id
    return got


def same(a: m.WireMessage, b: m.WireMessage) -> bool:
    """Field-wise equality, tensors compared by value."""
    if type(a) is not type(b):
        return False
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif isinstance(x, tuple) and x and isinstance(x[0], torch.Tensor):
            if len(x) != len(y) or not all(torch.equal(p, r) for p, r in zip(x, y)):
                return False
        elif x != y:
            return False
    return True


def refused(kind: Kind, body: dict, tensors=()) -> WireError:
    with pytest.raises(WireError) as info:
        m.parse(wire.decode(wire.encode(kind, 9, body, tensors)))
    assert info.value.msg_id == 9
    return info.value


# ---------------------------------------------------------------- one class per kind


def test_every_kind_has_exactly_one_message_class():
    assert set(m.TYPES) == set(Kind) == set(EXAMPLES)
    for kind, cls in m.TYPES.items():
        assert cls.KIND is kind and dataclasses.is_dataclass(cls)
        assert cls.__dataclass_params__.frozen, cls


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
def test_every_kind_round_trips(kind):
    message = EXAMPLES[kind]
    got = round_trip(message)
    assert same(got, message), (got, message)


def test_items_arrive_typed_and_tuples_stay_tuples():
    got = round_trip(EXAMPLES[Kind.REGISTER_QUERY_PLAN])
    item = got.tasks[1].items[0]
    assert isinstance(got.tasks[1], m.InstanceItems) and isinstance(item, m.AttendItem)
    assert item.slots == (0,) and isinstance(item.slots, tuple)
    assert isinstance(round_trip(EXAMPLES[Kind.PEER_PUT]).items[0], m.SlotWrite)
    assert isinstance(round_trip(EXAMPLES[Kind.REGISTER_TRANSFER_PLAN]).puts[1], m.PutTarget)


def test_tensor_messages_send_the_tensors_without_copying():
    frames = EXAMPLES[Kind.PEER_QUERY_RESULT].encode(1)
    assert len(frames) == 3
    assert frames[1].obj is not None and bytes(frames[1]) == Q.numpy().tobytes()


def test_put_omits_the_default_layer_count():
    assert m.Put(1, 3).body() == {"plan": 1, "layer": 3}
    assert round_trip(m.Put(1, 3)) == m.Put(1, 3, 1)
    assert m.Put(1, 0, 4).body()["layers"] == 4


def test_shifted_items_move_only_their_rows():
    item = m.AttendItem(5, 9, (1, 2), (8, 3))
    assert item.shifted(-5) == m.AttendItem(0, 4, (1, 2), (8, 3))


# ---------------------------------------------------------------- malformed bodies


def wrong_value(value):
    """A value of another type than ``value`` (a str for numbers, an int otherwise)."""
    return "x" if isinstance(value, (int, float, list)) and not isinstance(value, bool) else 3


CASES = [(k, f) for k in Kind for f in EXAMPLES[k].body() if not (k == Kind.PUT and f == "layers")]
#: Fields that may be absent (their default applies); a wrong type is still refused.
OPTIONAL = {(Kind.REGISTER_TRANSFER_PLAN, "copies"): (), (Kind.PEER_PUT, "copies"): (),
            (Kind.CP_STATS_RESULT, "sessions"): (), (Kind.ERROR, "request_ids"): (),
            (Kind.REGISTER_QUERY_PLAN, "grant"): b"", (Kind.REGISTER_TRANSFER_PLAN, "grant"): b"",
            (Kind.READ_SEGMENT, "grant"): b"", (Kind.CP_PLANS, "grants"): (),
            (Kind.CP_LEASED, "grants"): (), (Kind.CP_STATS_RESULT, "buffers"): (),
            (Kind.CP_MATCH, "salt"): None, (Kind.CP_LEASE_PREFIX, "cache_salt"): None,
            (Kind.ADOPT, "grant_key"): None, (Kind.CP_STATS_RESULT, "restored"): (),
            (Kind.PONG, "handoffs"): 0, (Kind.CP_CLIENT_INFO_RESULT, "slab"): None,
            (Kind.CP_CLIENT_INFO_RESULT, "peer_slabs"): (),
            (Kind.TIER_OPS, "drops"): (), (Kind.TIER_OPS, "writes"): (), (Kind.TIER_READ, "items"): (),
            (Kind.TIER_OPS, "epoch"): 0, (Kind.TIER_READ, "epoch"): 0,
            (Kind.TIER_READ, "layered"): False,
            (Kind.TIER_DONE, "done"): (), (Kind.TIER_DONE, "failed"): (), (Kind.TIER_DONE, "counters"): {},
            (Kind.TIER_LISTING, "entries"): ()}


@pytest.mark.parametrize(("kind", "name"), CASES, ids=[f"{k.name}-{f}" for k, f in CASES])
def test_a_missing_or_mistyped_field_is_named(kind, name):
    example = EXAMPLES[kind]
    body, tensors = example.body(), example.tensors()
    if (kind, name) in OPTIONAL:
        got = m.parse(wire.decode(wire.encode(kind, 5, {k: v for k, v in body.items() if k != name},
                                              tensors)))
        assert same(got, dataclasses.replace(example, **{name: OPTIONAL[(kind, name)]}))
    else:
        err = refused(kind, {k: v for k, v in body.items() if k != name}, tensors)
        assert err.field == name and str(err).startswith(f"{kind.name}: field {name!r}"), err
    err = refused(kind, body | {name: wrong_value(body[name])}, tensors)
    assert err.field == name and f"{kind.name}: field {name!r}" in str(err), err


@pytest.mark.parametrize(
    ("kind", "body", "field", "needle"),
    [
        (Kind.QUERY, {"plan": 1, "layer": True}, "layer", "must be an int, got True"),
        (Kind.QUERY, {"plan": 1.0, "layer": 0}, "plan", "must be an int, got 1.0"),
        (Kind.REGISTER_QUERY_PLAN, {"plan": 1, "rows": 2, "tasks": [[0]]}, "tasks[0]",
         "must have 2 entries"),
        (Kind.REGISTER_QUERY_PLAN, {"plan": 1, "rows": 2, "tasks": [["0", []]]}, "tasks[0][0]",
         "must be an int"),
        (Kind.REGISTER_QUERY_PLAN, {"plan": 1, "rows": 2, "tasks": [[0, [[0, 2, [1], ["8"]]]]]},
         "tasks[0][1][0][3][0]", "must be an int, got '8'"),
        (Kind.REGISTER_QUERY_PLAN, {"plan": 1, "rows": 2, "tasks": [[0, [[0, 2, 1, [8]]]]]},
         "tasks[0][1][0][2]", "must be a list"),
        (Kind.PEER_REGISTER_PLAN, {"home": 0, "plan": 1, "items": [[0, 2, [1]]]}, "items[0]",
         "must have 4 entries"),
        (Kind.REGISTER_TRANSFER_PLAN, {"plan": 1, "rows": 2, "puts": [[0, 1, 2, 0, None]]},
         "puts[0][4]", "must be an int, got None"),
        (Kind.PEER_PUT, {"layer": 0, "layers": 1, "items": [[1, 2]]}, "items[0]", "must have 3 entries"),
        (Kind.READ_SEGMENT, {"layer": 0, "slots": [1, "2"]}, "slots[1]", "must be an int"),
        (Kind.PONG, {"role": "query", "instance": 0, "bytes_copied": 0, "messages_copied": 0,
                     "requests": 0, "busy_s": "1"}, "busy_s", "must be a number"),
        (Kind.PEERS, {}, "peers", "non-empty list"),
        (Kind.PEERS, {"peers": []}, "peers", "non-empty list"),
        (Kind.PEERS, {"peers": [[1, "ipc:///tmp/x"]]}, "peers[0][1]", "not a tcp endpoint"),
        (Kind.PEERS, {"peers": [[1, "tcp://" + "a" * 300]]}, "peers[0][1]", "not a tcp endpoint"),
        (Kind.PEERS, {"peers": [["1", None]]}, "peers[0][0]", "must be an int"),
        (Kind.PEERS, {"peers": [[1]]}, "peers[0]", "malformed entry"),
        (Kind.ERROR, {"type": 3, "message": "x"}, "type", "must be a str"),
    ],
)
def test_nested_fields_are_named_by_their_path(kind, body, field, needle):
    err = refused(kind, body)
    assert err.field == field and f"{kind.name}: field {field!r}" in str(err) and needle in str(err), err


@pytest.mark.parametrize(
    ("kind", "tensors", "needle"),
    [
        (Kind.PEER_QUERY, (), "needs 1 tensor(s) (q), got 0"),
        (Kind.PEER_QUERY_RESULT, (Q,), "needs 2 tensor(s) (o, lse), got 1"),
        (Kind.PEER_PUT, (KV[0],), "needs 2 tensor(s) (1 items x 2 layers), got 1"),
        (Kind.SEGMENT_DATA, (SEG[0], SEG[1], SEG[1]), "needs 2 tensor(s) (one per slot), got 3"),
        (Kind.QUERY, (Q,), "needs 0 tensor(s), got 1"),
        (Kind.PING, (Q,), "needs 0 tensor(s), got 1"),
    ],
)
def test_the_tensor_count_is_part_of_the_schema(kind, tensors, needle):
    err = refused(kind, EXAMPLES[kind].body(), tensors)
    assert err.field == "tensors" and str(err).startswith(kind.name) and needle in str(err), err


def test_unknown_fields_are_ignored():
    """docs/protocol.md, Versioning: an optional field can be added without a bump."""
    body = EXAMPLES[Kind.COPY_SEGMENT].body() | {"priority": 3}
    assert m.parse(wire.decode(wire.encode(Kind.COPY_SEGMENT, 1, body))) == EXAMPLES[Kind.COPY_SEGMENT]


msgpack_leaf = st.none() | st.booleans() | st.integers(-5, 1 << 40) | st.floats() | st.text(max_size=5)
msgpack_value = st.recursive(msgpack_leaf, lambda inner: st.lists(inner, max_size=5), max_leaves=25)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(list(Kind)),
    data=st.data(),
    tensor_count=st.integers(0, 3),
)
def test_random_bodies_raise_only_wire_error(kind, data, tensor_count):
    """Bodies with the kind's field names (and others) holding random values."""
    names = [*EXAMPLES[kind].body(), "other"]
    body = data.draw(st.dictionaries(st.sampled_from(names), msgpack_value, max_size=len(names)))
    try:
        message = m.parse(wire.decode(wire.encode(kind, 1, body, [torch.zeros(2)] * tensor_count)))
    except WireError:
        return
    assert isinstance(message, m.TYPES[kind])


# ---------------------------------------------------------------- peer kinds


def test_peer_kinds_are_their_own_classes():
    assert {k.name for k in PEER_KINDS} == {
        "PEER_REGISTER_PLAN", "PEER_RELEASE_PLAN", "PEER_QUERY", "PEER_QUERY_RESULT",
        "PEER_PUT", "PEER_SEGMENT"}
    client_classes = {m.TYPES[k] for k in Kind if k not in PEER_KINDS}
    for kind in PEER_KINDS:
        assert m.TYPES[kind] not in client_classes
        assert not any(issubclass(m.TYPES[kind], c) for c in client_classes)


def test_a_client_query_with_peer_keys_is_still_a_client_query():
    """The old protocol told a peer query by its "key"; now the kind alone decides."""
    body = {"plan": 7, "layer": 1, "home": 0, "key": "0:7"}
    got = m.parse(wire.decode(wire.encode(Kind.QUERY, 1, body)))
    assert type(got) is m.Query and got == m.Query(7, 1)
    refused(Kind.QUERY, body, (Q,))  # with the peer's q frame it is malformed, not a peer query


def test_a_peer_message_under_a_client_kind_is_refused():
    for peer_kind, client_kind in [
        (Kind.PEER_QUERY, Kind.QUERY),
        (Kind.PEER_PUT, Kind.PUT),
        (Kind.PEER_REGISTER_PLAN, Kind.REGISTER_QUERY_PLAN),
    ]:
        peer = EXAMPLES[peer_kind]
        with pytest.raises(WireError, match=f"^{client_kind.name}: "):
            m.parse(wire.decode(wire.encode(client_kind, 1, peer.body(), peer.tensors())))


def test_a_client_message_under_a_peer_kind_is_refused():
    for client_kind, peer_kind, field in [
        (Kind.QUERY, Kind.PEER_QUERY, "tensors"),
        (Kind.RELEASE_PLAN, Kind.PEER_RELEASE_PLAN, "home"),
        (Kind.REGISTER_QUERY_PLAN, Kind.PEER_REGISTER_PLAN, "home"),
    ]:
        client = EXAMPLES[client_kind]
        err = refused(peer_kind, client.body(), client.tensors())
        assert err.field == field and str(err).startswith(peer_kind.name)


# ---------------------------------------------------------------- replies and plans


def test_expect_raises_typed_errors_and_refuses_other_kinds():
    ok = wire.decode(m.QueryDone(2).encode(5))
    assert m.expect(ok, m.QueryDone) == m.QueryDone(2)
    with pytest.raises(WireError, match="expected PUT_DONE in reply to message 5, got QUERY_DONE"):
        m.expect(ok, m.PutDone)
    with pytest.raises(CapacityError, match="pool full"):
        m.expect(wire.decode(wire.error_message(5, CapacityError("pool full"))), m.QueryDone)
    err = m.parse(wire.decode(wire.error_message(5, PlanError("bad rows"))))
    assert err == m.ErrorReply("PlanError", "bad rows") and isinstance(err.exception(), PlanError)


def test_plans_become_messages_once_with_tails_merged_by_instance():
    plan = QueryPlan(
        batch=0, part=0, home=0, num_rows=4, spans=(),
        tasks=(QueryTask(0, (QueryItem("a", 0, 2, (1, 2), (8, 8)),)),
               QueryTask(1, (QueryItem("b", 2, 4, (5,), (8,)),))),
        tails=(QueryTask(0, (QueryItem("a", 0, 2, (3,), (2,)),)),),
    )
    msg = m.RegisterQueryPlan.from_plan(11, plan)
    assert msg == m.RegisterQueryPlan(11, 4, (
        m.InstanceItems(0, (m.AttendItem(0, 2, (1, 2), (8, 8)), m.AttendItem(0, 2, (3,), (2,)))),
        m.InstanceItems(1, (m.AttendItem(2, 4, (5,), (8,)),)),
    ))
    tplan = TransferPlan(batch=0, part=0, home=1, num_rows=3, dedup_rows=0, puts=(
        PutItem(1, 4, 0, 0, 3, b"k"), PutItem(0, 6, 2, 1, 3, None)))
    assert m.RegisterTransferPlan.from_plan(12, tplan) == m.RegisterTransferPlan(
        12, 3, (m.PutTarget(1, 4, 0, 0, 3), m.PutTarget(0, 6, 2, 1, 3)))
    copied = dataclasses.replace(tplan, copies=(PageCopy(0, 5, 1, 4, 6),))
    assert m.RegisterTransferPlan.from_plan(12, copied).copies == (m.SlotCopy(0, 5, 1, 4, 6),)


def test_tier_counters_are_read_by_name_and_checked():
    """A TIER_DONE's counters: the known names read as numbers (a missing one absent, an
    unknown one ignored, from a newer engine), a counter of another type refused by path."""
    got = m.parse(wire.decode(wire.encode(Kind.TIER_DONE, 5, {"counters": {"reads": 2, "later": "x"}})))
    assert got.counters == {"reads": 2.0}
    err = refused(Kind.TIER_DONE, {"counters": {"paced_s": "1"}})
    assert err.field == "counters.paced_s" and "must be a number" in str(err)
    assert refused(Kind.TIER_DONE, {"counters": [1]}).field == "counters"
