"""The selectable GPU path (issue #21): ``LocalCluster(device="cuda")`` builds every
buffer on the GPU, shared with the engines by CUDA IPC handle, and the query engines
attend with one batched FlashInfer launch per layer (with torch where FlashInfer is not
installed). Without a GPU (CI) what can be checked
is: the refusals, the clean failure, the paged translation in tests/test_paged_plan.py.
The rest is marked ``gpu``; it passed on an H100 (``pytest -m gpu``, docs/design.md "GPU
path")."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch
from dataplane_util import TINY

from tokenlake.core.errors import ConfigError
from tokenlake.dataplane.shm_files import SharedMemoryError, list_buffers
from tokenlake.deploy.base import BufferLayout
from tokenlake.deploy.local import LocalCluster

C = 16
MINE = f"tokenlake-{os.getpid()}-"  # this process's pools' buffers (another test process's come and go)
POOL = 32 * TINY.num_layers * 2 * TINY.num_kv_heads * C * TINY.head_dim * 2


def test_a_gpu_pool_holds_half_kv_only():
    with pytest.raises(ConfigError, match="float16 or bfloat16"):
        LocalCluster(1, TINY, POOL, segment_tokens=C, device="cuda")


def test_the_layout_puts_every_buffer_on_the_device():
    layout = BufferLayout(TINY, 4, C, 8, "bfloat16", "cuda:1")
    specs = layout.specs("tokenlake-x-", 0)
    assert {s.device for n, s in specs.items() if n != "bell"} == {"cuda:1"}
    assert specs["bell"].device == "cpu"  # the hand-offs' rings are host memory (doorbell.py)
    assert specs["slab"].dtype == specs["kv"].dtype == "bfloat16" and specs["q"].dtype == "float32"


def _flashinfer_found(monkeypatch, found: bool) -> None:
    """Makes ``importlib.util.find_spec("flashinfer")`` find it or not; other names as they are."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if found else None) if name == "flashinfer" else real(name, *a))


def test_without_flashinfer_a_gpu_pool_attends_with_torch(monkeypatch, caplog):
    """FlashInfer is optional: a GPU pool's query engines then attend with the torch path
    (checked against the reference in tests/test_paged_plan.py), and the start-up log
    says so, with whether MPS is active."""
    import logging

    from tokenlake.deploy.gpu import gpu_setup
    from tokenlake.kernels import paged_torch
    from tokenlake.kernels.attention import partial_attention_ref

    _flashinfer_found(monkeypatch, False)
    monkeypatch.setattr(paged_torch, "flashinfer_usable", lambda: False)  # as if the import had failed
    setup = gpu_setup({"CUDA_MPS_PIPE_DIRECTORY": "/nonexistent-mps"})
    assert setup["attention"] == "torch" and setup["mps"] is False
    assert "FlashInfer is not installed" in setup["summary"] and "MPS is not active" in setup["summary"]
    slab, q = torch.randn(4, 2, 2, 2, C, 8).bfloat16(), torch.randn(3, 4, 8)
    got = paged_torch.gpu_slab_attention(q, slab, 1, [(0, 3, [0, 2], [C, 5])], 0.3)
    k = torch.cat([slab[0, 1, 0].transpose(0, 1), slab[2, 1, 0, :, :5].transpose(0, 1)]).double()
    v = torch.cat([slab[0, 1, 1].transpose(0, 1), slab[2, 1, 1, :, :5].transpose(0, 1)]).double()
    want_o, want_lse = partial_attention_ref(q.double(), k, v, scale=0.3)
    torch.testing.assert_close(got.o.double(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    with caplog.at_level(logging.INFO, logger="tokenlake.deploy.base"):
        LocalCluster(1, TINY, POOL, segment_tokens=C, kv_dtype="bfloat16", device="cuda")  # not started
    assert any("query engines attend with torch" in r.getMessage() for r in caplog.records)


def test_mps_is_seen_by_its_control_pipe(tmp_path):
    from tokenlake.deploy.gpu import gpu_setup, mps_active

    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert not mps_active(env)
    (tmp_path / "control").touch()
    assert mps_active(env) and gpu_setup(env)["mps"] and "MPS is active" in gpu_setup(env)["summary"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure without CUDA")
def test_without_cuda_a_gpu_pool_fails_to_start_and_leaves_nothing(monkeypatch):
    _flashinfer_found(monkeypatch, True)  # as if installed: CUDA is what is missing
    before = set(list_buffers(MINE))
    with pytest.raises(SharedMemoryError, match="CUDA is unavailable"):
        with LocalCluster(2, TINY, POOL, segment_tokens=C, kv_dtype="bfloat16", device="cuda"):
            pass
    assert set(list_buffers(MINE)) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_pool_serves_the_data_plane_scenario():
    from dataclasses import replace

    from test_dataplane import run_iteration

    model = replace(TINY, name="tiny-gpu", head_dim=64)  # a head size FlashInfer compiles
    with LocalCluster(2, model, 4 * POOL, segment_tokens=C, max_rows=64, kv_dtype="bfloat16",
                      device="cuda") as cluster:
        assert cluster.slab(0).is_cuda
        rng = random.Random(0)
        tokens = {"g": [rng.randrange(3, 900) for _ in range(3 * C + 4)]}
        run_iteration(cluster, tokens, {"g": 3 * C + 2}, model=model)
        run_iteration(cluster, tokens, {"g": 1}, model=model)
        cluster.control.finish_request("g")
