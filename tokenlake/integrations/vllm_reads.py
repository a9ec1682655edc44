"""The load mode's reads (:mod:`tokenlake.integrations.vllm_load`): the leased segments of a
step's loads copied into vLLM's blocks, layer by layer, as vLLM reaches each layer.

:meth:`PageLoader.start` (``start_load_kv``) asks the transfer engines for the first
:data:`LOAD_AHEAD_LAYERS` layers of the leased slots (``READ_SEGMENT``, one message per
instance and layer) and :meth:`PageLoader.receive_layer` (``wait_for_layer_load``) copies
a layer into the requests' blocks just before vLLM computes it, asking for one more layer
each time: the transfers overlap the forward pass. On the pool's machine a CPU
instance's slab is shared memory that the control server names
(``CP_CLIENT_INFO_RESULT.slab``): it is mapped once and each layer of the leased slots is
copied straight from it, all but the last, which is read by message after the others as
the lease's check (:meth:`PageLoader.receive_layer`); ``TOKENLAKE_LOAD_IN_PLACE=0`` reads
every layer by message. A load that fails reports its blocks as load errors, so vLLM
computes them.

The reads by message go through the session's :class:`~tokenlake.dataplane.segment_reader.SegmentReader`
(``RemoteControlPlane.reader``), one per instance, on a connection of their own
(:data:`READ_CONNECTION`), not through the worker's data-plane client
(``RemoteControlPlane.client``), for two reasons. That client maps the session's shared
buffers on the instance, which only map on the pool's machine, while a read needs none
(the data comes in the reply): reading through it would stop loads where the slabs do
not map either (another machine, another ``/dev/shm``). And a read that fails drops its
connection with the replies still owed on it, and the next load opens a new one with the
endpoints the server gives then (engines restarted), without touching the store's
client on the same instance, whose puts may be in flight.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from tokenlake.core.errors import TokenLakeError
from tokenlake.dataplane.segment_reader import SegmentReader
from tokenlake.integrations.vllm_meta import Load
from tokenlake.integrations.vllm_slabs import SlabMaps
from tokenlake.service.remote import RemoteControlPlane

log = logging.getLogger(__name__)

#: The connection number of the worker's reads (the connector's sides join with 1 and 2).
READ_CONNECTION = 3

#: "0" in the worker's environment: every layer is read by ``READ_SEGMENT``, even from an
#: instance whose slab this process could map (:class:`~tokenlake.integrations.vllm_slabs.SlabMaps`).
IN_PLACE_ENV = "TOKENLAKE_LOAD_IN_PLACE"

#: Layers requested ahead of the one vLLM waits for (the transfers of later layers overlap
#: the computation of earlier ones; bounds the replies held in memory).
LOAD_AHEAD_LAYERS = 4


class _Loading:
    """A load in progress: its segments' indices by instance, the instances read in place
    (``in_place``: instance -> its mapped slab), the replies it still expects, in order
    (layer, instance, message id), and how many layers are in vLLM's blocks."""

    def __init__(self, load: Load) -> None:
        self.load = load
        self.by_instance: dict[int, list[int]] = {}
        for i, (inst, _slot) in enumerate(load.segments):
            self.by_instance.setdefault(inst, []).append(i)
        self.in_place: dict[int, torch.Tensor] = {}
        self.expected: deque[tuple[int, int, int]] = deque()
        self.done_layers = 0
        self.failed = False


class PageLoader:
    """The worker side's loads of one step at a time into vLLM's KV caches (see the
    module). ``caches``: layer index -> that layer's cache ``[num_blocks, kv_heads,
    block_size, 2 * head_dim]``, set by ``register_kv_caches``."""

    def __init__(self, cp: RemoteControlPlane, per_seg: int, block_size: int) -> None:
        self.cp, self.per_seg, self.block_size = cp, per_seg, block_size
        self.caches: dict[int, torch.Tensor] = {}
        self._readers: dict[int, SegmentReader] = {}
        self._slabs = SlabMaps(cp, IN_PLACE_ENV, "loads read")  # instance -> its slab mapped, or None
        self._loading: list[_Loading] = []  # this pass's loads, received layer by layer
        self._layers: list[int] = []
        self._next = 0  # index into _layers of the next layer to request
        self.errors: set[int] = set()  # blocks of failed loads, not yet reported to vLLM
        self.loaded_tokens = 0

    @property
    def pending(self) -> bool:
        """Whether this pass has loads (vLLM's layer waits have work)."""
        return bool(self._loading)

    def start(self, loads: list[Load]) -> None:
        """Maps the slabs this step's loads can read in place and requests the first
        layers of the others (``start_load_kv``)."""
        self.finish()  # a previous pass's leftovers (none when vLLM waited per layer)
        self._layers = sorted(self.caches)
        self._next = 0
        self._loading = []
        for load in loads:
            ld = _Loading(load)
            self._loading.append(ld)
            if len(self._layers) < 2:  # the last layer is the lease's check: none in place
                continue
            try:
                ld.in_place = {inst: slab for inst in ld.by_instance
                               if (slab := self._slabs.get(inst)) is not None}
            except Exception as e:  # the instance's client info: reading by message needs it too
                self._load_failed(ld, e)
        while self._next < min(LOAD_AHEAD_LAYERS, len(self._layers)):
            self._request_layer()

    def _request_layer(self) -> None:
        """Asks the transfer engines for the next layer of every load (``READ_SEGMENT``
        per instance not read in place), without waiting: the replies queue while vLLM
        computes."""
        layer = self._layers[self._next]
        self._next += 1
        for ld in self._loading:
            if ld.failed:
                continue
            try:
                for inst in ld.by_instance:
                    if inst not in ld.in_place:
                        self._send_read(ld, inst, layer)
            except Exception as e:
                self._load_failed(ld, e)

    def _send_read(self, ld: _Loading, inst: int, layer: int) -> None:
        """One ``READ_SEGMENT``: ``layer`` of the load's slots on ``inst``, with the
        lease's grant there (the engine serves it only while the lease holds)."""
        slots = [ld.load.segments[i][1] for i in ld.by_instance[inst]]
        grant = dict(ld.load.grants).get(inst, b"")
        msg_id = self._reader(inst).read(layer, slots, grant, self.cp.timeout_s)
        ld.expected.append((layer, inst, msg_id))

    def receive_layer(self, layer: int) -> None:
        """Copies ``layer`` of every load into vLLM's blocks, then requests one more layer.

        Slots of a mapped slab are copied straight from it, the others from their replies
        (requested ``LOAD_AHEAD_LAYERS`` layers ago). The last layer of a mapped slab is
        read by message, sent once every other layer is copied: the lease's check. The
        engine serves it only while the lease's grant holds, and the server retires that
        grant before it releases the lease, so a request finished during its load (an
        abort under vLLM's asynchronous scheduling) fails its load instead of keeping
        pages of slots that may have been given away meanwhile."""
        cache, last = self.caches[layer], len(self._layers) - 1
        for ld in self._loading:
            if ld.failed or ld.done_layers > last or self._layers[ld.done_layers] != layer:
                continue
            try:
                pages = self._replies(ld, layer)
                if ld.done_layers < last:
                    for inst, slab in ld.in_place.items():
                        for i in ld.by_instance[inst]:
                            pages[i] = slab[ld.load.segments[i][1], layer]
                self._copy_pages(ld, pages, cache)
                ld.done_layers += 1
                if ld.done_layers == last:
                    for inst in ld.in_place:
                        self._send_read(ld, inst, self._layers[last])
                elif ld.done_layers > last:
                    load = ld.load
                    self.loaded_tokens += sum(len(b) for b in load.blocks) * self.block_size - \
                        load.skip * self.block_size
            except Exception as e:
                self._load_failed(ld, e)
        if self._next < len(self._layers):
            self._request_layer()

    def _replies(self, ld: _Loading, layer: int) -> list:
        """The load's segments of ``layer`` that came by message (``None`` for the others)."""
        pages = [None] * len(ld.load.segments)
        while ld.expected and ld.expected[0][0] == layer:
            _, inst, msg_id = ld.expected.popleft()
            try:
                blocks = self._reader(inst).receive(msg_id, self.cp.timeout_s)
            except Exception:  # its reply may still come: not to be taken for a later read's
                self._drop_reader(inst)
                raise
            for i, block in zip(ld.by_instance[inst], blocks):
                pages[i] = block
        return pages

    def _copy_pages(self, ld: _Loading, pages: list, cache: torch.Tensor) -> None:
        """One layer of every segment of the load into its vLLM blocks (those vLLM
        computed itself, ``skip``, are left alone); a segment not read fails the load."""
        for i, block in enumerate(pages):
            if block is None:
                raise TokenLakeError(f"segment {i} of the load was not read")
            dst = ld.load.blocks[i]
            copy_pages(block, self.per_seg, cache, dst, ld.load.skip if i == 0 else 0)

    def _load_failed(self, ld: _Loading, error: BaseException) -> None:
        """vLLM computes the load's blocks instead (never wrong tokens); the readers that
        still owe it replies are closed so later reads stay in step (as is one whose
        read failed, :meth:`_replies`)."""
        log.warning("request %s: loading from the pool failed: %s", ld.load.request_id, error)
        ld.failed = True
        self.errors.update(b for blocks in ld.load.blocks for b in blocks)
        for inst in {inst for _, inst, _ in ld.expected}:
            self._drop_reader(inst)
        ld.expected.clear()

    def finish(self) -> None:
        """Receives every layer still owed (a pass that did not wait for each layer)."""
        while True:
            pending = [self._layers[ld.done_layers] for ld in self._loading
                       if not ld.failed and ld.done_layers < len(self._layers)]
            if not pending:
                break
            self.receive_layer(min(pending))
        self._loading = []

    def take_errors(self) -> set[int]:
        errors, self.errors = self.errors, set()
        return errors

    def _reader(self, instance: int) -> SegmentReader:
        """``instance``'s reader, opened on first use (and again after a failure)."""
        if instance not in self._readers:
            self._readers[instance] = self.cp.reader(instance, READ_CONNECTION)
        return self._readers[instance]

    def _drop_reader(self, instance: int) -> None:
        """Closes ``instance``'s reader with the replies it still owes; the next read
        opens a new one (with the endpoints the server gives then)."""
        reader = self._readers.pop(instance, None)
        if reader is not None:
            reader.close()

    def close(self) -> None:
        """Closes the readers and unmaps the slabs (the connector closes; the pool still
        owns them)."""
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self._slabs.close()


def copy_pages(block: torch.Tensor, per_seg: int, cache: torch.Tensor, dst, skip: int = 0) -> None:
    """Pages ``skip .. len(dst)`` of a slab slot's layer into vLLM's blocks ``dst[skip:]``
    of ``cache``: what ``cache[dst[skip:]] = pages_of_slot(block, ...)[skip:len(dst)]``
    does, in one strided pass per run of consecutive blocks (a layer of a long document
    is copied once, not permuted into a temporary first and scattered from there)."""
    rows = block.permute(2, 0, 1, 3)  # [C, 2, kv_heads, head_dim]: the pages' bytes, a view
    per_page = rows.shape[0] // per_seg
    pages = None  # pages_of_slot's, made once if a run needs them
    p = skip
    while p < len(dst):
        q = p + 1
        while q < len(dst) and dst[q] == dst[q - 1] + 1:
            q += 1
        out = cache[dst[p]:dst[p] + q - p]
        if cache.dtype == block.dtype and out.is_contiguous():
            out.view(-1, *rows.shape[1:]).copy_(rows[p * per_page:q * per_page])
        else:  # another layout or dtype: as pages_of_slot gives them
            pages = pages_of_slot(block, per_seg, cache.shape) if pages is None else pages
            out.copy_(pages[p:q])
        p = q


def pages_of_slot(block: torch.Tensor, per_seg: int, cache_shape) -> torch.Tensor:
    """A slab slot's layer ``[2, kv_heads, C, head_dim]`` back to the vLLM pages it was
    stored from: the put wrote the pages as rows ``[C, 2, kv_heads, head_dim]`` (the
    same bytes), and the transfer engine stored row ``r`` at token ``r`` of the slot."""
    rows = block.permute(2, 0, 1, 3).contiguous()  # [C, 2, kv_heads, head_dim]
    return rows.reshape(per_seg, *cache_shape[1:])
