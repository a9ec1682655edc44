"""The load mode of :mod:`tokenlake.integrations.vllm`: the pool holds vLLM's pages.

The pool holds vLLM's KV pages as they are: a segment of ``C`` tokens is ``C /
block_size`` vLLM blocks of one layer each, copied byte for byte (the CPU kernels may pack
a block's K, so a block is opaque here). The pool's namespace must be the ``vllm-cpu``
layout and ``C`` a multiple of vLLM's block size; the connector refuses other pools.

Scheduler side: every step, the prompt segments that step completes are planned for
storing (``gen_plans``, one sub-batch at the connector's instance). Worker side:
``start_load_kv`` asks the transfer engines for the leased slots of the first
:data:`LOAD_AHEAD_LAYERS` layers (``READ_SEGMENT``, one message per instance and layer)
and ``wait_for_layer_load`` copies each layer into the request's blocks just before vLLM
computes it, asking for one more layer each time: the transfers overlap the forward
pass. On the pool's machine a CPU instance's slab is shared memory that the control
server names (``CP_CLIENT_INFO_RESULT.slab``): the worker maps it once and copies each
layer of the leased slots straight from it, all but the last, which is read by message
after the others as the lease's check (``_receive_layer``); ``TOKENLAKE_LOAD_IN_PLACE=0``
reads every layer by message. A load that fails reports its blocks as load errors, so
vLLM computes them.
``save_kv_layer`` copies the completed segments' pages into the home instance's shared
``kv`` buffer and puts the layer (asynchronous); ``wait_for_save`` waits and commits the
plans (``complete``).
"""

from __future__ import annotations

import logging
import os
from collections import deque

import torch

from tokenlake.core.errors import TokenLakeError
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.dataplane import wire
from tokenlake.dataplane.auth import ClusterKeys, connect_secure
from tokenlake.dataplane.messages import ReadSegment, SegmentData, expect
from tokenlake.dataplane.messages.session import alias
from tokenlake.dataplane.shm import SharedTensor
from tokenlake.dataplane.sockets import send
from tokenlake.integrations.vllm_meta import Load, Store, TokenLakeMetadata, layer_index

#: The connection number of the worker's reads (the sides join with 1 and 2).
READ_CONNECTION = 3

log = logging.getLogger(__name__)

#: "0" in the worker's environment: every layer is read by ``READ_SEGMENT``, even from an
#: instance whose slab this process could map (``LoadMode._slab``).
IN_PLACE_ENV = "TOKENLAKE_LOAD_IN_PLACE"

#: Load mode: layers requested ahead of the one vLLM waits for (the transfers of later
#: layers overlap the computation of earlier ones; bounds the replies held in memory).
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


class LoadMode:
    """The load mode's methods of :class:`~tokenlake.integrations.vllm.TokenLakeConnector`."""

    def _plan_store(self, done: dict[str, int]) -> Store | None:
        """One sub-batch storing the prompt segments completed by this step."""
        reqs, rows = [], []
        budget = self.max_rows
        for rid, upto in done.items():
            prompt = self._prompts.get(rid)
            if prompt is None:
                continue
            have = self._pool_len.get(rid, 0)
            end = min(upto, len(prompt)) // self.C * self.C
            end = min(end, have + budget // self.C * self.C)
            if end <= have:
                continue
            prefix = ()
            if rid not in self._admitted:
                prefix = tuple(prompt[:have])
            reqs.append(BatchRequest(rid, tuple(prompt[have:end]), prefix,
                                     self._salts.get(rid, self.cache_salt)))
            rows.append((rid, self._blocks[rid][have // self.block_size: end // self.block_size]))
            budget -= end - have
        if not reqs:
            return None
        try:
            plans = self.cp.gen_plans([Batch(tuple(reqs))], [1], homes=[self.home])
        except TokenLakeError as e:  # a full pool, an evicted prefix: this step stores nothing
            log.info("not storing this step's segments: %s", e)
            return None
        for r in reqs:
            self._admitted.add(r.request_id)
            self._pool_len[r.request_id] = self._pool_len.get(r.request_id, 0) + \
                len(r.new_token_ids)
        return Store(plans, rows, self.cp.plan_grants(plans))

    def _start_loads(self, meta: TokenLakeMetadata) -> None:
        """Maps the slabs this step's loads can read in place and requests the first
        layers of the others (``start_load_kv``)."""
        self._finish_loads()  # a previous pass's leftovers (none when vLLM waited per layer)
        self._layers = sorted(self._caches)
        self._next = 0  # index into self._layers of the next layer to request
        self._loading = []
        for load in meta.loads:
            ld = _Loading(load)
            self._loading.append(ld)
            if len(self._layers) < 2:  # the last layer is the lease's check: none in place
                continue
            try:
                ld.in_place = {inst: slab for inst in ld.by_instance
                               if (slab := self._slab(inst)) is not None}
            except Exception as e:  # the instance's client info: the socket path needs it too
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
        slots = tuple(ld.load.segments[i][1] for i in ld.by_instance[inst])
        msg_id = next(self._msg_ids)
        read = ReadSegment(layer, slots, dict(ld.load.grants).get(inst, b""))
        send(self._sock(inst), read.encode(msg_id), timeout_s=self.cp.timeout_s)
        ld.expected.append((layer, inst, msg_id))

    def _receive_layer(self, layer: int) -> None:
        """Copies ``layer`` of every load into vLLM's blocks, then requests one more layer.

        Slots of a mapped slab are copied straight from it, the others from their replies
        (requested ``LOAD_AHEAD_LAYERS`` layers ago). The last layer of a mapped slab is
        read by message, sent once every other layer is copied: the lease's check. The
        engine serves it only while the lease's grant holds, and the server retires that
        grant before it releases the lease, so a request finished during its load (an
        abort under vLLM's asynchronous scheduling) fails its load instead of keeping
        pages of slots that may have been given away meanwhile."""
        cache, last = self._caches[layer], len(self._layers) - 1
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
            reply = wire.recv(self._sock(inst), self.cp.timeout_s)
            if reply.msg_id != msg_id:
                raise TokenLakeError(f"instance {inst} answered message {reply.msg_id}, "
                                     f"expected {msg_id}")
            data = expect(reply, SegmentData)
            for i, block in zip(ld.by_instance[inst], data.blocks):
                pages[i] = block
        return pages

    def _copy_pages(self, ld: _Loading, pages: list, cache: torch.Tensor) -> None:
        """One layer of every segment of the load into its vLLM blocks (those vLLM
        computed itself, ``skip``, are left alone); a segment not read fails the load."""
        for i, block in enumerate(pages):
            if block is None:
                raise TokenLakeError(f"segment {i} of the load was not read")
            dst = ld.load.blocks[i]
            skip = ld.load.skip if i == 0 else 0
            if skip < len(dst):
                src = _pages_of_slot(block, self.per_seg, cache.shape)
                cache[dst[skip:]] = src[skip:len(dst)]

    def _load_failed(self, ld: _Loading, error: BaseException) -> None:
        """vLLM computes the load's blocks instead (never wrong tokens); the replies still
        owed on its sockets are dropped so later reads stay in step."""
        log.warning("request %s: loading from the pool failed: %s", ld.load.request_id, error)
        ld.failed = True
        self._load_errors.update(b for blocks in ld.load.blocks for b in blocks)
        for inst in {inst for _, inst, _ in ld.expected}:
            sock = self._socks.pop(inst, None)
            if sock is not None:
                sock.close(0)
        ld.expected.clear()

    def _finish_loads(self) -> None:
        """Receives every layer still owed (a pass that did not wait for each layer)."""
        while True:
            pending = [self._layers[ld.done_layers] for ld in self._loading
                       if not ld.failed and ld.done_layers < len(self._layers)]
            if not pending:
                break
            self._receive_layer(min(pending))
        self._loading = []

    def _sock(self, instance: int):
        if instance not in self._socks:
            import zmq

            info = self.cp.client_info(instance)
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # this session's other socket to the engine (the worker's client has one)
            sock.setsockopt(zmq.ROUTING_ID, alias(self.cp.token, READ_CONNECTION))
            keys = None if info.keys is None else ClusterKeys.from_dict(dict(info.keys))
            connect_secure(sock, keys)
            sock.connect(info.endpoints["transfer"])
            self._socks[instance] = sock
        return self._socks[instance]

    def _slab(self, instance: int) -> torch.Tensor | None:
        """``instance``'s slab mapped in this process (read only: its leased slots are
        copied from it), or ``None``: its segments are read by ``READ_SEGMENT``. Mapped
        on first use and kept until :meth:`_close_slabs`; a failure to ask the control
        server is raised (the load fails, as on the socket path) and asked again next time."""
        if instance not in self._slabs:
            self._slabs[instance] = self._map_slab(instance)
        shared = self._slabs[instance]
        return None if shared is None else shared.tensor

    def _map_slab(self, instance: int) -> SharedTensor | None:
        """The control server offers a slab it knows to be POSIX shared memory on its
        machine (``CP_CLIENT_INFO_RESULT.slab``); a client on another machine (or in
        another ``/dev/shm``) fails to map it and reads by message, as does one with
        ``TOKENLAKE_LOAD_IN_PLACE=0``."""
        if os.environ.get(IN_PLACE_ENV, "1") == "0":
            return None
        spec = self.cp.client_info(instance).slab
        if spec is None or spec.is_cuda:
            return None
        try:
            shared = SharedTensor.attach(spec)
        except Exception as e:
            log.info("instance %d's slab is not mappable here (%s): reading it by message",
                     instance, e)
            return None
        log.info("reading instance %d's slab in place (%s)", instance, spec.name)
        return shared

    def _close_slabs(self) -> None:
        """Unmaps the slabs (the connector closes; the pool still owns them)."""
        for shared in self._slabs.values():
            if shared is not None:
                shared.close()
        self._slabs.clear()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._loading:
            self._receive_layer(layer_index(layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, TokenLakeMetadata) or meta.store is None:
            return
        layer = layer_index(layer_name)
        (tp,) = meta.store.plans.transfer_plans
        self.cp.adopt_grants(meta.store.plans, meta.store.grants)  # the scheduler side's
        client = self._client(tp.home)
        if self._kv_buf is None:
            self._kv_buf = client.init_transfer(tp)
        row = 0
        for _rid, blocks in meta.store.rows:
            n = len(blocks) * self.block_size
            pages = kv_layer[blocks]  # [blocks, kv_heads, block_size, 2 * head_dim]
            self._kv_buf[layer, row:row + n] = pages.reshape(n, *self._kv_buf.shape[2:])
            row += n
        self._puts.append(client.put(layer))

    def _finish_store(self) -> None:
        """Waits for this step's puts and commits its store plan (``wait_for_save``)."""
        meta = self._get_connector_metadata()
        puts, self._puts, self._kv_buf = self._puts, [], None
        if not isinstance(meta, TokenLakeMetadata) or meta.store is None:
            return
        plans = meta.store.plans
        try:
            for handle in puts:
                handle.wait()
            self.cp.complete(plans)
            self.stored_tokens += sum(len(b) for _, b in meta.store.rows) * self.block_size
        except Exception as e:  # nothing of this step becomes visible
            log.warning("storing this step's segments failed: %s", e)
            try:
                self.cp.abort(plans)
            except TokenLakeError:
                pass


def _pages_of_slot(block: torch.Tensor, per_seg: int, cache_shape) -> torch.Tensor:
    """A slab slot's layer ``[2, kv_heads, C, head_dim]`` back to the vLLM pages it was
    stored from: the put wrote the pages as rows ``[C, 2, kv_heads, head_dim]`` (the
    same bytes), and the transfer engine stored row ``r`` at token ``r`` of the slot."""
    rows = block.permute(2, 0, 1, 3).contiguous()  # [C, 2, kv_heads, head_dim]
    return rows.reshape(per_seg, *cache_shape[1:])

