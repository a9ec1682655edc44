"""Whose KV a pool holds is part of its namespace (issue #18): a pool for vLLM's CPU pages
and one for TokenLake's own engine never share a key, a client reads the pool's namespace
and segment size over the control port, and ``tokenlake serve --kv-layout vllm-cpu``
serves the control port without the HTTP API."""

from __future__ import annotations

import threading

import pytest
from dataplane_util import TINY
from test_service import POOL_BYTES, C

import tokenlake
from tokenlake.core.control import KV_LAYOUTS, pool_control
from tokenlake.core.errors import ConfigError
from tokenlake.service.local import serve_local


def test_the_layout_is_part_of_the_namespace():
    own, vllm = (pool_control(1, TINY, POOL_BYTES, C, 4, clock=lambda: 0.0, kv_layout=k)
                 for k in KV_LAYOUTS)
    assert own.config.namespace != vllm.config.namespace
    assert vllm.config.namespace.endswith("/vllm-cpu")
    tokens = list(range(1, 4 * C + 1))
    assert set(own.pool.hasher.keys(tokens)).isdisjoint(vllm.pool.hasher.keys(tokens))
    with pytest.raises(ConfigError, match="kv_layout"):
        pool_control(1, TINY, POOL_BYTES, C, 4, clock=lambda: 0.0, kv_layout="paged")


def test_serve_for_vllm_offers_the_control_port_with_its_layout():
    stop, ready, errors, served = threading.Event(), threading.Event(), [], []

    def run() -> None:
        try:
            serve_local(TINY, 1, POOL_BYTES, C, 64, control_port=0, http_port=0,
                        kv_layout="vllm-cpu", stop=stop,
                        on_ready=lambda s: (served.append(s.info()), ready.set()))
        except Exception as e:  # reported below
            errors.append(e)
            ready.set()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert ready.wait(120) and not errors, errors
        info = served[0]
        assert info["http_url"] is None  # vLLM computes: no HTTP API here
        with tokenlake.connect(info["address"]) as cp:
            namespace, segment_tokens = cp.layout()
        assert namespace.endswith("/vllm-cpu") and segment_tokens == C
    finally:
        stop.set()
        thread.join(60)
    assert not errors, errors
