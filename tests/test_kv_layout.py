"""Whose KV a pool holds is part of its namespace (issue #18): a pool for vLLM's CPU pages
and one for TokenLake's own engine never share a key, a client reads the pool's namespace
and segment size over the control port, and ``tokenlake serve --kv-layout vllm-cpu``
serves the control port without the HTTP API."""

from __future__ import annotations

import pytest
from dataplane_util import TINY
from service_util import serving_locally
from test_service import POOL_BYTES, C

import tokenlake
from tokenlake.core.control import KV_LAYOUTS, pool_control
from tokenlake.core.errors import ConfigError


def test_the_layout_is_part_of_the_namespace():
    pools = {k: pool_control(1, TINY, POOL_BYTES, C, "float32", clock=lambda: 0.0, kv_layout=k)
             for k in KV_LAYOUTS}
    assert set(KV_LAYOUTS) == {"tokenlake", "vllm-cpu", "hf"}
    assert pools["vllm-cpu"].config.namespace.endswith("/vllm-cpu")
    assert pools["hf"].config.namespace.endswith("/hf")
    tokens = list(range(1, 4 * C + 1))
    keys = {k: set(cp.pool.hasher.keys(tokens)) for k, cp in pools.items()}
    for a in KV_LAYOUTS:  # no two layouts share a namespace or a key
        for b in KV_LAYOUTS:
            if a < b:
                assert pools[a].config.namespace != pools[b].config.namespace
                assert keys[a].isdisjoint(keys[b]), (a, b)
    with pytest.raises(ConfigError, match="kv_layout"):
        pool_control(1, TINY, POOL_BYTES, C, "float32", clock=lambda: 0.0, kv_layout="paged")


def test_serve_for_vllm_offers_the_control_port_with_its_layout():
    with serving_locally(TINY, 1, POOL_BYTES, C, 64, control_port=0, http_port=0,
                         kv_layout="vllm-cpu") as served:
        info = served.info()
        assert info["http_url"] is None  # vLLM computes: no HTTP API here
        with tokenlake.connect(info["address"]) as cp:
            namespace, segment_tokens = cp.layout()
        assert namespace.endswith("/vllm-cpu") and segment_tokens == C
