"""vLLM's load mode reads a slab in place on the pool's machine (issue #41, item 5).

The control server offers a client session each CPU instance's slab
(``CP_CLIENT_INFO_RESULT.slab``); the connector maps it once and copies a load's leased
slots straight from it, every layer but the last, which it reads by ``READ_SEGMENT`` once
the others are copied (the lease's check). Where the slab cannot be mapped it reads every
layer by message. The end-to-end tests with vLLM processes are in
tests/test_vllm_connector.py; these drive the connector's load-mode methods directly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from dataplane_util import TINY

import tokenlake
from tokenlake.core.errors import EngineUnavailable
from tokenlake.dataplane.shm import SharedTensor
from tokenlake.dataplane.shm_files import BufferSpec
from tokenlake.deploy.local import LocalCluster
from tokenlake.service.server import ControlServer

C = 8
POOL_BYTES = 16 * TINY.num_layers * 2 * TINY.num_kv_heads * C * TINY.head_dim * 4  # 16 slots


def test_a_client_session_is_offered_each_cpu_slab():
    """The spec a session gets maps the very slab the engines write."""
    with LocalCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=64) as cluster, \
            ControlServer(cluster) as server, \
            tokenlake.connect(server.address, credentials=server.credentials()) as cp:
        for i in (0, 1):
            spec = cp.client_info(i).slab
            assert spec is not None and spec.shape == tuple(cluster.slab(i).shape)
            with SharedTensor.attach(spec) as shared:
                cluster.slab(i)[3, 1].fill_(float(i + 1))
                assert torch.equal(shared.tensor[3, 1], cluster.slab(i)[3, 1])


# ------------------------------------------------------------ the connector's side

pytest.importorskip("vllm")  # the connector's modules import vLLM's base classes

from tokenlake.integrations import vllm_load  # noqa: E402
from tokenlake.integrations.vllm_load import LoadMode, _pages_of_slot  # noqa: E402
from tokenlake.integrations.vllm_meta import Load  # noqa: E402

BLOCK, LAYERS = 4, 6  # vLLM blocks of 4 tokens, segments of one block
SLAB_SHAPE = (4, LAYERS, 2, 1, BLOCK, 2)  # [slots, layers, 2, kv_heads, C, head_dim]


class FakeControl:
    """The control server's answer to ``client_info``: only the slab matters here."""

    def __init__(self, slab: BufferSpec | None) -> None:
        self.slab, self.asked = slab, 0

    def client_info(self, instance: int):
        self.asked += 1
        return SimpleNamespace(slab=self.slab)


def loader(mapped: bool):
    """A LoadMode with vLLM's caches ([blocks, kv_heads, block_size, 2 * head_dim] per
    layer) and one instance's slab (``lm.source``), mapped or not; its reads by message
    are recorded (layer, layers copied by then) and answered from the same slab."""
    lm = LoadMode()
    lm._caches = {layer: torch.zeros(8, 1, BLOCK, 4) for layer in range(LAYERS)}
    lm._loading, lm._layers, lm._next, lm._load_errors = [], [], 0, set()
    lm.per_seg, lm.block_size, lm.C, lm.loaded_tokens = 1, BLOCK, BLOCK, 0
    lm.sent, lm.copied = [], []
    source = torch.arange(torch.Size(SLAB_SHAPE).numel(), dtype=torch.float32).reshape(SLAB_SHAPE)
    lm.source = source

    def send_read(ld, inst, layer):  # what the transfer engine would answer
        lm.sent.append((layer, len(lm.copied)))
        ld.expected.append((layer, inst, 0))

    def replies(ld, layer):
        pages = [None] * len(ld.load.segments)
        while ld.expected and ld.expected[0][0] == layer:
            _, inst, _ = ld.expected.popleft()
            if lm.lease_ended:
                raise vllm_load.TokenLakeError("NotAuthorized: the grant was retired")
            for i in ld.by_instance[inst]:
                pages[i] = source[ld.load.segments[i][1], layer]
        return pages

    lm._send_read, lm._replies, lm.lease_ended = send_read, replies, False
    lm._slab = lambda inst: source if mapped else None
    return lm


def load_all(lm) -> None:
    meta = SimpleNamespace(loads=[Load("r", [(0, 1), (0, 3)], [[5], [6]], 0, ((0, b"g"),))])
    lm._start_loads(meta)
    for layer in range(LAYERS):
        lm._receive_layer(layer)
        lm.copied.append(layer)


def expected_block(lm, slot: int, layer: int) -> torch.Tensor:
    return _pages_of_slot(lm.source[slot, layer], 1, lm._caches[layer].shape)[0]


@pytest.mark.parametrize("mapped", [True, False], ids=["in-place", "by-message"])
def test_a_load_copies_every_layer_of_every_segment(mapped):
    """In place, only the last layer goes by message, sent after every other layer is
    in vLLM's blocks; without a slab, every layer does, LOAD_AHEAD_LAYERS ahead."""
    lm = loader(mapped)
    load_all(lm)
    for layer in range(LAYERS):
        assert torch.equal(lm._caches[layer][5], expected_block(lm, 1, layer))
        assert torch.equal(lm._caches[layer][6], expected_block(lm, 3, layer))
    assert not lm._load_errors and lm.loaded_tokens == 2 * BLOCK
    if mapped:
        assert lm.sent == [(LAYERS - 1, LAYERS - 2)]  # after layer LAYERS-2 was copied
    else:
        ahead = vllm_load.LOAD_AHEAD_LAYERS
        assert [layer for layer, _ in lm.sent] == list(range(LAYERS))
        assert lm.sent[:ahead] == [(layer, 0) for layer in range(ahead)]


def test_a_lease_that_ended_during_the_load_makes_its_blocks_load_errors():
    """The request finished while its slots were copied (its grant retired): the check
    fails, so vLLM computes the blocks instead of trusting what was copied."""
    lm = loader(True)
    lm.lease_ended = True
    load_all(lm)
    assert lm._load_errors == {5, 6} and lm.loaded_tokens == 0


def test_an_unreachable_instance_fails_the_load_not_the_step():
    lm = loader(True)

    def dead(inst):
        raise EngineUnavailable("the transfer engine of instance 0 is not running")

    lm._slab = dead
    load_all(lm)
    assert lm._load_errors == {5, 6} and lm.sent == []


def test_the_slab_is_mapped_once_or_not_at_all(tmp_path, monkeypatch):
    """Mapped on first use and kept; ``None`` (read by message) when the server offers
    none, offers a CUDA one, names a buffer this machine does not have, or when
    TOKENLAKE_LOAD_IN_PLACE=0."""
    spec = BufferSpec(f"tokenlake-test-{tmp_path.name}-slab-0", SLAB_SHAPE, "float32")
    with SharedTensor.create(spec) as made:
        made.tensor[2, 1].fill_(7.0)
        lm = LoadMode()
        lm.cp, lm._slabs = FakeControl(spec), {}
        slab = lm._slab(0)
        assert slab is not None and float(slab[2, 1].max()) == 7.0
        assert lm._slab(0) is slab and lm.cp.asked == 1
        shared = lm._slabs[0]
        lm._close_slabs()
        assert lm._slabs == {} and shared.closed
    cuda = BufferSpec("tokenlake-test-cuda", SLAB_SHAPE, "float16", "cuda:0", b"handle")
    missing = BufferSpec("tokenlake-test-never-made-slab-0", SLAB_SHAPE, "float32")
    for offered in (None, cuda, missing):
        lm = LoadMode()
        lm.cp, lm._slabs = FakeControl(offered), {}
        assert lm._slab(0) is None
    monkeypatch.setenv(vllm_load.IN_PLACE_ENV, "0")
    lm = LoadMode()
    lm.cp, lm._slabs = FakeControl(missing), {}
    assert lm._slab(0) is None and lm.cp.asked == 0
