"""vLLM's load mode reads a slab in place on the pool's machine (issue #41, item 5).

The control server offers a client session each CPU instance's slab
(``CP_CLIENT_INFO_RESULT.slab``); the connector maps it once and copies a load's leased
slots straight from it, every layer but the last, which it reads by ``READ_SEGMENT`` once
the others are copied (the lease's check). Where the slab cannot be mapped it reads every
layer by message, through the session's ``SegmentReader``. The end-to-end tests with vLLM
processes are in tests/test_vllm_connector.py; these drive the load mode's
``PageLoader`` directly, and the session's reader against a served pool."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from dataplane_util import TINY

import tokenlake
from tokenlake.core.errors import ConfigError, EngineUnavailable, NotAuthorized
from tokenlake.core.plans import Batch, BatchRequest
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


def test_a_session_reads_its_leased_slots_by_message():
    """``RemoteControlPlane.reader``: reads pipelined on a connection of the session's
    own, answered in order with the slots' layers as the slab holds them; only with the
    lease's grant, and not once the lease ended."""
    doc = tuple(range(100, 100 + 2 * C + 1))
    with LocalCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=64) as cluster, \
            ControlServer(cluster) as server, \
            tokenlake.connect(server.address, credentials=server.credentials()) as cp:
        control = server.shared_control()
        control.complete(control.gen_plans([Batch((BatchRequest("seed", doc),))], [1]))
        control.finish_request("seed")
        locs = cp.lease_prefix("r", doc[:2 * C])
        inst = locs[0].instance
        slots = [loc.slot for loc in locs if loc.instance == inst]
        for layer in range(TINY.num_layers):
            for s in slots:
                cluster.slab(inst)[s, layer].fill_(float(10 * s + layer))
        with pytest.raises(ConfigError, match="connection"):
            cp.reader(inst, cp.connection)
        reader = cp.reader(inst, 3)
        grant = cp.read_grant("r", inst)
        ids = [reader.read(layer, slots, grant) for layer in range(TINY.num_layers)]
        for layer, msg_id in enumerate(ids):
            blocks = reader.receive(msg_id, 10.0)
            assert len(blocks) == len(slots)
            for s, block in zip(slots, blocks):
                assert torch.equal(block, cluster.slab(inst)[s, layer])
        with pytest.raises(NotAuthorized):  # another grant than the lease's
            reader.receive(reader.read(0, slots, b"x" * len(grant)), 10.0)
        cp.finish_request("r")
        with pytest.raises(NotAuthorized):  # the lease ended: its grant is spent
            reader.receive(reader.read(0, slots, grant), 10.0)
        reader.close()
        assert reader.closed
        with pytest.raises(EngineUnavailable, match="closed"):
            reader.read(0, slots, grant)
        left_open = cp.reader(inst, 3)
    assert left_open.closed  # the session's close closes the readers it opened


# ------------------------------------------------------------ the connector's side

pytest.importorskip("vllm")  # the connector's modules import vLLM's base classes

from tokenlake.integrations import vllm_reads  # noqa: E402
from tokenlake.integrations.vllm_meta import Load  # noqa: E402
from tokenlake.integrations.vllm_reads import PageLoader, pages_of_slot  # noqa: E402

BLOCK, LAYERS = 4, 6  # vLLM blocks of 4 tokens, segments of one block
SLAB_SHAPE = (4, LAYERS, 2, 1, BLOCK, 2)  # [slots, layers, 2, kv_heads, C, head_dim]


class FakeReader:
    """A transfer engine's answers to ``READ_SEGMENT``, from ``source``, in order."""

    def __init__(self, control: FakeControl) -> None:
        self.control, self.owed, self.closed = control, [], False

    def read(self, layer, slots, grant, timeout_s):
        self.control.sent.append((layer, len(self.control.copied)))
        self.owed.append((layer, tuple(slots)))
        return len(self.control.sent)

    def receive(self, msg_id, timeout_s):
        layer, slots = self.owed.pop(0)
        if self.control.lease_ended:
            raise NotAuthorized("the grant was retired")
        return tuple(self.control.source[s, layer] for s in slots)

    def close(self):
        self.closed = True


class FakeControl:
    """The session as the loader uses it: ``client_info`` (only the slab matters here)
    and ``reader``; its reads are recorded (layer, layers copied by then)."""

    timeout_s = 1.0

    def __init__(self, slab: BufferSpec | None = None) -> None:
        self.slab, self.asked, self.readers = slab, 0, []
        self.sent, self.copied, self.lease_ended = [], [], False
        self.source = torch.arange(torch.Size(SLAB_SHAPE).numel(),
                                   dtype=torch.float32).reshape(SLAB_SHAPE)

    def client_info(self, instance: int):
        self.asked += 1
        return SimpleNamespace(slab=self.slab)

    def reader(self, instance: int, connection: int) -> FakeReader:
        assert connection == vllm_reads.READ_CONNECTION
        self.readers.append(FakeReader(self))
        return self.readers[-1]


def loader(mapped: bool) -> PageLoader:
    """A PageLoader with vLLM's caches ([blocks, kv_heads, block_size, 2 * head_dim] per
    layer) and one instance's slab (``cp.source``), mapped or not."""
    pl = PageLoader(FakeControl(), per_seg=1, block_size=BLOCK)
    pl.caches = {layer: torch.zeros(8, 1, BLOCK, 4) for layer in range(LAYERS)}
    pl._slabs.get = lambda inst: pl.cp.source if mapped else None
    return pl


def load_all(pl: PageLoader) -> None:
    pl.start([Load("r", [(0, 1), (0, 3)], [[5], [6]], 0, ((0, b"g"),))])
    for layer in range(LAYERS):
        pl.receive_layer(layer)
        pl.cp.copied.append(layer)


def expected_block(pl: PageLoader, slot: int, layer: int) -> torch.Tensor:
    return pages_of_slot(pl.cp.source[slot, layer], 1, pl.caches[layer].shape)[0]


@pytest.mark.parametrize("mapped", [True, False], ids=["in-place", "by-message"])
def test_a_load_copies_every_layer_of_every_segment(mapped):
    """In place, only the last layer goes by message, sent after every other layer is
    in vLLM's blocks; without a slab, every layer does, LOAD_AHEAD_LAYERS ahead."""
    pl = loader(mapped)
    load_all(pl)
    for layer in range(LAYERS):
        assert torch.equal(pl.caches[layer][5], expected_block(pl, 1, layer))
        assert torch.equal(pl.caches[layer][6], expected_block(pl, 3, layer))
    assert not pl.take_errors() and pl.loaded_tokens == 2 * BLOCK
    if mapped:
        assert pl.cp.sent == [(LAYERS - 1, LAYERS - 2)]  # after layer LAYERS-2 was copied
    else:
        ahead = vllm_reads.LOAD_AHEAD_LAYERS
        assert [layer for layer, _ in pl.cp.sent] == list(range(LAYERS))
        assert pl.cp.sent[:ahead] == [(layer, 0) for layer in range(ahead)]
    assert len(pl.cp.readers) == 1  # one reader per instance, kept
    pl.close()
    assert pl.cp.readers[0].closed


def test_a_lease_that_ended_during_the_load_makes_its_blocks_load_errors():
    """The request finished while its slots were copied (its grant retired): the check
    fails, so vLLM computes the blocks instead of trusting what was copied; the reader
    that owed the load replies is closed, and the next read opens a new one."""
    pl = loader(True)
    pl.cp.lease_ended = True
    load_all(pl)
    assert pl.take_errors() == {5, 6} and pl.loaded_tokens == 0
    assert pl.take_errors() == set()
    pl.cp.lease_ended = False
    pl.cp.copied.clear()
    load_all(pl)
    assert pl.take_errors() == set() and pl.loaded_tokens == 2 * BLOCK
    assert [r.closed for r in pl.cp.readers] == [True, False]


def test_an_unreachable_instance_fails_the_load_not_the_step():
    pl = loader(True)

    def dead(inst):
        raise EngineUnavailable("the transfer engine of instance 0 is not running")

    pl._slabs.get = dead
    load_all(pl)
    assert pl.take_errors() == {5, 6} and pl.cp.sent == []


def test_the_slab_is_mapped_once_or_not_at_all(tmp_path, monkeypatch):
    """Mapped on first use and kept; ``None`` (read by message) when the server offers
    none, offers a CUDA one, names a buffer this machine does not have, or when
    TOKENLAKE_LOAD_IN_PLACE=0."""
    spec = BufferSpec(f"tokenlake-test-{tmp_path.name}-slab-0", SLAB_SHAPE, "float32")
    with SharedTensor.create(spec) as made:
        made.tensor[2, 1].fill_(7.0)
        pl = PageLoader(FakeControl(spec), 1, BLOCK)
        slab = pl._slabs.get(0)
        assert slab is not None and float(slab[2, 1].max()) == 7.0
        assert pl._slabs.get(0) is slab and pl.cp.asked == 1
        shared = pl._slabs._maps[0]
        pl.close()
        assert pl._slabs._maps == {} and shared.closed
    cuda = BufferSpec("tokenlake-test-cuda", SLAB_SHAPE, "float16", "cuda:0", b"handle")
    missing = BufferSpec("tokenlake-test-never-made-slab-0", SLAB_SHAPE, "float32")
    for offered in (None, cuda, missing):
        pl = PageLoader(FakeControl(offered), 1, BLOCK)
        assert pl._slabs.get(0) is None
    monkeypatch.setenv(vllm_reads.IN_PLACE_ENV, "0")
    pl = PageLoader(FakeControl(missing), 1, BLOCK)
    assert pl._slabs.get(0) is None and pl.cp.asked == 0


def test_slabs_mapped_from_the_home_ask_about_the_home_only(tmp_path):
    """With a home (vLLM's query mode), every slab comes from the home instance's
    ``client_info`` (``peer_slabs``): no session is opened on another instance to map
    its slab, and one the server does not offer is not mapped."""
    from tokenlake.integrations.vllm_slabs import SlabMaps

    specs = [BufferSpec(f"tokenlake-test-{tmp_path.name}-slab-{i}", SLAB_SHAPE, "float32") for i in (0, 1)]
    asked = []

    class Home:
        def client_info(self, instance):
            asked.append(instance)
            return SimpleNamespace(instance=instance, slab=specs[0], peer_slabs=((1, specs[1]),))

    with SharedTensor.create(specs[0]) as s0, SharedTensor.create(specs[1]) as s1:
        s0.tensor.fill_(1.0)
        s1.tensor.fill_(2.0)
        maps = SlabMaps(Home(), "TOKENLAKE_TEST_UNSET", "test", home=0)
        assert float(maps.get(1).max()) == 2.0 and float(maps.get(0).max()) == 1.0
        assert maps.get(2) is None  # not offered
        assert asked == [0, 0, 0]  # the home's answer, every time (once per instance)
        maps.close()


@pytest.mark.parametrize("dst, skip", [
    ([4, 5, 6, 7], 0),     # one run of blocks
    ([9, 2, 3, 11], 1),    # three runs, the first page computed by vLLM itself
    ([6, 7], 0),           # a partial segment: its first two pages only
    ([3, 1, 0, 2], 0),     # every block on its own
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_go_into_vllms_blocks_as_the_page_layout_says(dst, skip, dtype):
    """``copy_pages`` (one strided copy per run of consecutive blocks) writes exactly what
    scattering ``pages_of_slot``'s pages writes, and nothing else of the cache; a cache
    of another dtype is filled the same way, by values."""
    per_seg, block = 4, 2  # C = 8 tokens, four pages of two
    slot = torch.randn(2, 3, per_seg * block, 4).to(dtype)  # [2, kv_heads, C, head_dim]
    for cache_dtype in (dtype, torch.float32):
        want = torch.full((12, 3, block, 8), 7.0, dtype=cache_dtype)
        got = want.clone()
        src = pages_of_slot(slot, per_seg, want.shape)
        want[dst[skip:]] = src[skip:len(dst)].to(cache_dtype)
        vllm_reads.copy_pages(slot, per_seg, got, dst, skip)
        assert torch.equal(got, want)
    # a cache whose blocks are not contiguous (a view of a larger one): the same pages
    wide = torch.full((12, 3, block, 16), 7.0, dtype=dtype)
    got, want = wide[..., :8], wide.clone()[..., :8]
    want[dst[skip:]] = pages_of_slot(slot, per_seg, want.shape)[skip:len(dst)]
    vllm_reads.copy_pages(slot, per_seg, got, dst, skip)
    assert torch.equal(got, want) and (wide[..., 8:] == 7.0).all()
