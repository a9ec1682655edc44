"""Tests of the wire format (tokenlake/dataplane/wire.py, docs/protocol.md, docs/design.md §4 Wire/Failure).

Round trips of every allowlisted dtype, the zero-copy claim on the send path (frames
alias the tensors, CopyStats stays 0), a malformed message never raising anything but
WireError, ERROR replies becoming typed exceptions, and no pickle anywhere on the wire.
Real sockets: tests/test_sockets.py; the typed bodies of each kind: tests/test_messages.py.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenlake.core.errors import (
    CapacityError,
    PrefixNotCached,
    SegmentInFlight,
    SegmentNotFound,
    TokenLakeError,
)
from tokenlake.dataplane import messages, sockets, tensor_frames, wire
from tokenlake.dataplane.tensor_frames import DTYPES, CopyStats, TensorMeta, WireError
from tokenlake.dataplane.wire import (
    Kind,
    Message,
    RemoteError,
    decode,
    encode,
    error_message,
    raise_if_error,
)

#: Every module that reads or writes what crosses a socket.
WIRE_MODULES = [wire, sockets, tensor_frames, *(
    Path(messages.__file__).parent.glob("*.py"))]


@pytest.fixture(autouse=True)
def _fresh_copy_stats():
    CopyStats.reset()
    yield
    CopyStats.reset()


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    hi = 256 if dtype == torch.uint8 else 1 << 20
    return torch.randint(0, hi, shape, generator=g).to(dtype)


def header(**overrides) -> bytes:
    """A packed header, valid unless overridden (a value of ... drops the key)."""
    h = {"v": wire.PROTOCOL_VERSION, "k": int(Kind.PING), "id": 1, "b": {}, "t": []}
    h.update(overrides)
    return msgpack.packb({k: v for k, v in h.items() if v is not ...}, use_bin_type=True)


def storage_address(frame) -> int:
    return np.frombuffer(frame, dtype=np.uint8).ctypes.data


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(2, 3, 4), (), (0,), (3, 0, 2), (1, 5, 1)])
def test_round_trip_every_dtype_and_shape(name, shape):
    t = sample(DTYPES[name], shape)
    msg = decode(encode(Kind.QUERY, 5, {"plan_id": 1}, [t, t]))
    assert msg.kind is Kind.QUERY and msg.msg_id == 5 and msg.body == {"plan_id": 1}
    assert len(msg.tensors) == 2
    for got in msg.tensors:
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got, t)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_round_trip_through_bytes_frames(name):
    """Frames as they come from recv_multipart(copy=True): read-only bytes."""
    t = sample(DTYPES[name], (4, 7), seed=1)
    frames = [bytes(f) for f in encode(Kind.PUT, 2, None, [t])]
    (got,) = decode(frames).tensors
    assert torch.equal(got, t)


def test_round_trip_large_tensor():
    t = torch.arange(1 << 21, dtype=torch.float32).reshape(1 << 11, 1 << 10)  # 8 MiB
    (got,) = decode(encode(Kind.SEGMENT_DATA, 9, {}, [t])).tensors
    assert torch.equal(got, t)
    assert CopyStats.bytes_copied == 0


def test_round_trip_numpy_arrays_including_read_only():
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    b = np.linspace(0, 1, 6, dtype=np.float16)
    b.flags.writeable = False
    got = decode(encode(Kind.PUT, 1, {}, [a, b])).tensors
    assert torch.equal(got[0], torch.from_numpy(a))
    assert torch.equal(got[1], torch.from_numpy(b.copy()))


def test_empty_body_and_no_tensors():
    msg = decode(encode(Kind.PING, 0))
    assert msg == Message(Kind.PING, 0, {}, ())


def test_tuples_in_a_body_come_back_as_lists():
    assert decode(encode(Kind.PUT, 1, {"items": ((1, 2, 3),)})).body == {"items": [[1, 2, 3]]}


msgpack_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
msgpack_value = st.recursive(
    msgpack_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=100, deadline=None)
@given(
    body=st.dictionaries(st.text(max_size=10), msgpack_value, max_size=6),
    kind=st.sampled_from(list(Kind)),
    msg_id=st.integers(min_value=0, max_value=(1 << 64) - 1),
)
def test_nested_bodies_round_trip(body, kind, msg_id):
    msg = decode(encode(kind, msg_id, body))
    assert (msg.kind, msg.msg_id, msg.body) == (kind, msg_id, body)


# ---------------------------------------------------------------- zero copy


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_encode_frames_alias_the_tensor_storage(name):
    t = sample(DTYPES[name], (8, 16))
    frames = encode(Kind.QUERY, 1, {}, [t])
    assert isinstance(frames[1], memoryview)
    assert storage_address(frames[1]) == t.data_ptr()
    assert len(frames[1]) == t.numel() * t.element_size()
    before = bytes(frames[1])
    t.zero_()  # a write after encode shows in the frame: it is the same memory
    assert bytes(frames[1]) == bytes(len(before)) != before
    assert CopyStats.bytes_copied == 0 and CopyStats.messages == 0


def test_encode_of_views_and_numpy_is_zero_copy():
    slab = torch.randn(4, 3, 2, 2, 8, 4)  # [slots, layers, 2, kv_heads, C, head_dim]
    seg = slab[2]  # one slot: contiguous across all layers (docs/design.md §4 pool layout)
    frames = encode(Kind.SEGMENT_DATA, 1, {}, [seg])
    assert storage_address(frames[1]) == seg.data_ptr() == slab[2].data_ptr()
    arr = np.ones((5, 6), dtype=np.float32)
    assert storage_address(encode(Kind.PUT, 1, {}, [arr])[1]) == arr.ctypes.data
    leaf = torch.ones(3, requires_grad=True)
    assert storage_address(encode(Kind.PUT, 1, {}, [leaf])[1]) == leaf.data_ptr()
    assert CopyStats.bytes_copied == 0


def test_decode_of_writable_aligned_frames_is_zero_copy():
    t = torch.randn(64, 8)
    (got,) = decode(encode(Kind.QUERY, 1, {}, [t])).tensors
    assert got.data_ptr() == t.data_ptr()
    assert CopyStats.bytes_copied == 0


def test_decode_copies_read_only_frames_and_counts_the_copy():
    t = torch.randn(10, 3)
    frames = [bytes(f) for f in encode(Kind.QUERY, 1, {}, [t, t])]
    got = decode(frames).tensors
    assert CopyStats.bytes_copied == 2 * t.numel() * 4 and CopyStats.messages == 1
    got[0].add_(1)  # a private, writable copy: the frame is untouched
    assert torch.equal(decode(frames).tensors[0], t)


def test_decode_copies_misaligned_frames():
    t = torch.arange(6, dtype=torch.float64)
    raw = bytearray(1 + 48)
    raw[1:] = t.numpy().tobytes()
    frame = memoryview(raw)[1:]  # writable but at an odd address
    (got,) = decode([encode(Kind.QUERY, 1, {}, [t])[0], frame]).tensors
    assert torch.equal(got, t) and got.data_ptr() % 8 == 0
    assert CopyStats.bytes_copied == 48


# ---------------------------------------------------------------- malformed input

BIG = 1 << 20


@pytest.mark.parametrize(
    ("frames", "needle"),
    [
        ([], "no frames"),
        ([b""], "header frame is empty"),
        ([b"\xc1"], "not valid msgpack"),
        ([b"\x93\x01"], "not valid msgpack"),  # truncated array
        ([header() + b"\x00"], "not valid msgpack"),  # trailing bytes
        ([b"\xff\xfe garbage"], "not valid msgpack"),
        ([msgpack.packb([1, 2, 3])], "not a map"),
        ([header(v=3)], "unsupported protocol version 3 (this peer speaks 4)"),
        ([header(v=5)], "unsupported protocol version 5"),
        ([header(v=True)], "unsupported protocol version"),
        ([header(v=1.0)], "unsupported protocol version 1.0"),
        ([header(v=...)], "unsupported protocol version None"),
        ([header(k=99)], "unknown message kind 99"),
        ([header(k="PING")], "not an int"),
        ([header(id=-1)], "header id"),
        ([header(id=1.5)], "header id"),
        ([header(id=False)], "header id"),
        ([header(b=...)], "missing ['b']"),
        ([header(extra=1)], "unexpected"),
        ([header(b=[1])], "body is a list"),
        ([header(b={1: 2})], "key 1 is a int, not a str"),
        ([header(b={"x": {b"k": 2}})], "not a str"),
        ([header(b={"x": msgpack.ExtType(5, b"zz")})], "extension type 5 is not allowed"),
        ([header(b={"x": msgpack.Timestamp(1)})], "not a msgpack-native value"),
        ([header(t={})], "'t' is a dict"),
        ([header(t=[["float32", [2]]])], "declares 1 tensors but 0 tensor frames"),
        ([header(), b"\x00" * 4], "declares 0 tensors but 1 tensor frames"),
        ([header(t=[["float32", [2]]]), bytes(7)], "needs 8 bytes but its frame has 7"),
        ([header(t=[["float32", [2]]]), bytes(12)], "needs 8 bytes but its frame has 12"),
        ([header(t=[["object", [1]]]), bytes(8)], "dtype 'object' is not one of"),
        ([header(t=[["int16", [1]]]), bytes(2)], "dtype 'int16' is not one of"),
        ([header(t=[[3, [1]]]), bytes(2)], "dtype 3"),
        ([header(t=[["uint8", [-1]]]), b""], "negative dimension"),
        ([header(t=[["uint8", [2, -2]]]), bytes(4)], "negative dimension"),
        ([header(t=[["uint8", [1.0]]]), bytes(1)], "non-integer dimension"),
        ([header(t=[["uint8", [True]]]), bytes(1)], "non-integer dimension"),
        ([header(t=[["uint8", [1] * 17]]), bytes(1)], "17 dimensions"),
        ([header(t=[["uint8"]]), bytes(1)], "not [dtype, [shape...]]"),
        ([header(t=[["uint8", 3]]), bytes(3)], "not [dtype, [shape...]]"),
        ([header(t=[["float64", [1 << 62, 1 << 62]]]), bytes(1)], "needs"),
        ([header(b={"x": b"a" * BIG})], "at most 1048576"),
        ([header(), "a str frame"], "frame 1 is a str"),
        ([header(), 12345], "frame 1 is not a contiguous bytes-like buffer"),
        ([header(), memoryview(bytes(8))[::2]], "frame 1 is not a contiguous bytes-like buffer"),
        (
            [header(t=[["float32", [2]]]), np.zeros(4, dtype=np.float32)[::2]],
            "frame 1 is not a contiguous bytes-like buffer",
        ),
        (b"bytes, not a list of frames", "list of buffers"),
    ],
)
def test_malformed_messages_raise_wire_error(frames, needle):
    with pytest.raises(WireError) as info:
        decode(frames)
    assert needle in str(info.value)


def test_wire_error_carries_the_msg_id_when_the_header_was_readable():
    with pytest.raises(WireError) as info:
        decode([header(id=42, k=99)])
    assert info.value.msg_id == 42
    with pytest.raises(WireError) as info:
        decode([b"\xc1"])
    assert info.value.msg_id is None


def test_deeply_nested_body_is_refused_not_a_recursion_error():
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(WireError, match="nested deeper"):
        encode(Kind.PING, 1, {"x": deep})
    prefix = b"\x85\xa1v\x01\xa1k\x01\xa2id\x01\xa1t\x90\xa1b\x81\xa1x"  # ..."b": {"x":
    for depth in (100, 100_000):  # past our limit; past msgpack's own stack limit
        with pytest.raises(WireError):
            decode([prefix + b"\x91" * depth + b"\xc0"])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_random_frames_raise_only_wire_error(frames):
    try:
        decode(frames)
    except WireError:
        pass


tensor_entry = st.lists(
    st.one_of(
        st.sampled_from([*DTYPES, "object", "int16"]),
        st.lists(st.integers(min_value=-3, max_value=8), max_size=4),
        msgpack_leaf,
    ),
    max_size=3,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fields=st.fixed_dictionaries(
        {},
        optional={
            "v": st.sampled_from([2, 2, 2, 1, 3, 0, "2", None]),
            "k": st.sampled_from([*map(int, Kind), 0, 99, -1, "k"]),
            "id": st.one_of(st.integers(min_value=-5, max_value=(1 << 64) - 1), msgpack_leaf),
            "b": st.one_of(
                st.dictionaries(st.text(max_size=3), msgpack_value, max_size=3), msgpack_value
            ),
            "t": st.one_of(st.lists(tensor_entry, max_size=3), msgpack_leaf),
            "x": msgpack_leaf,
        },
    ),
    payloads=st.lists(st.binary(max_size=40), max_size=3),
)
def test_structured_garbage_raises_only_wire_error(fields, payloads):
    try:
        msg = decode([msgpack.packb(fields, use_bin_type=True), *payloads])
    except WireError:
        return
    assert isinstance(msg.kind, Kind) and len(msg.tensors) == len(payloads)


# ---------------------------------------------------------------- encode refuses


def test_encode_refuses_non_contiguous_tensors_instead_of_copying():
    t = torch.randn(4, 6)
    for bad in (t.t(), t[:, ::2], t.unsqueeze(0).expand(2, 4, 6)):
        with pytest.raises(WireError, match="not contiguous"):
            encode(Kind.QUERY, 1, {}, [bad])
    with pytest.raises(WireError, match="not C-contiguous"):
        encode(Kind.QUERY, 1, {}, [np.ones((4, 6), dtype=np.float32).T])
    assert CopyStats.bytes_copied == 0


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"kind": 99}, "unknown message kind 99"),
        ({"kind": True}, "not an int"),
        ({"msg_id": -1}, "msg_id"),
        ({"msg_id": 1 << 64}, "msg_id"),
        ({"msg_id": "7"}, "msg_id"),
        ({"body": [1]}, "body must be a dict"),
        ({"body": {1: "x"}}, "key 1 is a int, not a str"),
        ({"body": {"n": np.int64(3)}}, "numpy.int64 is not a msgpack-native value"),
        ({"body": {"s": {1, 2}}}, "set is not a msgpack-native value"),
        ({"body": {"big": 1 << 64}}, "does not fit in 64 bits"),
        ({"body": {"x": b"a" * BIG}}, "at most 1048576"),
        ({"tensors": [torch.zeros(2, dtype=torch.int16)]}, "dtype torch.int16"),
        ({"tensors": [torch.zeros(2, dtype=torch.complex64)]}, "dtype torch.complex64"),
        ({"tensors": [torch.zeros(2, dtype=torch.bool)]}, "dtype torch.bool"),
        ({"tensors": [np.array([object()])]}, "dtype object"),
        ({"tensors": [np.zeros(2, dtype=">f4")]}, "non-native byte order"),
        ({"tensors": [[1.0, 2.0]]}, "not a torch.Tensor or numpy.ndarray"),
        ({"tensors": torch.zeros(2, 3)}, "wrap a single tensor in a list"),
        ({"tensors": [torch.zeros(2, 2).to_sparse()]}, "only dense CPU"),
    ],
)
def test_encode_refuses_bad_input_with_wire_error(kwargs, needle):
    args = {"kind": Kind.PUT, "msg_id": 1, "body": {}, "tensors": ()} | kwargs
    with pytest.raises(WireError) as info:
        encode(**args)
    assert needle in str(info.value)


def test_tensor_meta_validates_and_sizes():
    assert TensorMeta("bfloat16", (3, 4)).nbytes == 24
    assert TensorMeta("float64", ()).nbytes == 8
    with pytest.raises(WireError):
        TensorMeta("object", (1,))
    with pytest.raises(WireError):
        TensorMeta("uint8", (-1,))


# ---------------------------------------------------------------- errors across the wire


def test_error_message_round_trips_to_the_typed_exception():
    for exc in (CapacityError("pool full"), SegmentNotFound("seg 3 gone"), WireError("bad")):
        msg = decode(error_message(7, exc))
        assert msg.kind is Kind.ERROR and msg.msg_id == 7
        assert msg.body == {"type": type(exc).__name__, "message": str(exc)}
        with pytest.raises(type(exc)) as info:
            raise_if_error(msg)
        assert str(info.value) == str(exc)


def test_errors_that_name_requests_keep_them_across_the_wire():
    """A serving loop on a served pool takes the requests an error names out of the
    iteration (the rest is planned): ``SegmentInFlight`` and ``PrefixNotCached``."""
    for exc in (SegmentInFlight("stored by another", ("r1", "r2")),
                PrefixNotCached("only 0 of 32", ("r3",))):
        msg = decode(error_message(5, exc))
        with pytest.raises(type(exc)) as info:
            raise_if_error(msg)
        assert info.value.request_ids == exc.request_ids and str(info.value) == str(exc)


def test_unknown_remote_types_become_remote_error():
    msg = decode(error_message(3, ValueError("no such layer")))
    with pytest.raises(RemoteError) as info:
        raise_if_error(msg)
    assert isinstance(info.value, TokenLakeError)
    assert info.value.remote_type == "ValueError"
    assert "no such layer" in str(info.value)
    # passing a RemoteError on keeps the origin's type name
    forwarded = decode(error_message(4, info.value))
    assert forwarded.body == {"type": "ValueError", "message": "no such layer"}
    # a name that merely looks dangerous is never looked up outside tokenlake.core.errors
    evil = decode(encode(Kind.ERROR, 1, {"type": "SystemExit", "message": "bye"}))
    with pytest.raises(RemoteError):
        raise_if_error(evil)


def test_raise_if_error_passes_other_messages_and_checks_error_bodies():
    ok = decode(encode(Kind.PONG, 1))
    assert raise_if_error(ok) is ok
    with pytest.raises(WireError, match="lacks str 'type' and 'message'"):
        raise_if_error(decode(encode(Kind.ERROR, 1, {"type": 3})))


def test_error_text_is_truncated_to_fit_a_header():
    msg = decode(error_message(1, CapacityError("x" * (2 * BIG))))
    assert len(msg.body["message"]) < wire.MAX_ERROR_TEXT + 100


# ---------------------------------------------------------------- security


@pytest.mark.parametrize("module", WIRE_MODULES, ids=lambda m: getattr(m, "__name__", None) or m.name)
def test_wire_never_imports_pickle(module):
    source = (module if isinstance(module, Path) else Path(module.__file__)).read_text()
    pattern = re.compile(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle|marshal|shelve)\b", re.M)
    assert not pattern.search(source)
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert not imported & {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}
    assert "pyobj" not in source  # pyzmq's send_pyobj/recv_pyobj pickle
