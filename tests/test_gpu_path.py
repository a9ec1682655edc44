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


def test_a_flashinfer_that_is_installed_but_does_not_import_is_reported_as_such(monkeypatch):
    """The start-up report says what the engines will do: they import FlashInfer, so a
    package that is found but fails to import (here: found, and absent) means torch."""
    from tokenlake.deploy.gpu import gpu_setup

    _flashinfer_found(monkeypatch, True)
    setup = gpu_setup({"CUDA_MPS_PIPE_DIRECTORY": "/nonexistent-mps"})
    assert setup["attention"] == "torch"
    assert "installed but does not import" in setup["summary"]


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


def test_a_pool_on_cuda_spreads_its_instances_over_the_visible_gpus(monkeypatch):
    """``device="cuda"``: instance ``i``'s buffers on ``cuda:{i % gpus}``, ``gpus`` the GPUs
    this process sees (at most one per instance); ``"cuda:N"`` keeps them all on GPU N;
    a bell stays in host memory. The layout only: no GPU here."""
    from tokenlake.deploy.gpu import gpus_for

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert (gpus_for("cuda"), gpus_for("cuda:1"), gpus_for("cpu")) == (2, 1, 1)
    cluster = LocalCluster(3, TINY, 3 * POOL, segment_tokens=C, kv_dtype="bfloat16", device="cuda")
    assert cluster.layout.gpus == 2
    devices = [cluster.layout.specs("tokenlake-x-", i)["slab"].device for i in range(3)]
    assert devices == ["cuda:0", "cuda:1", "cuda:0"]
    session = cluster.layout.session_specs("tokenlake-x-", 1, 1)
    assert session["q"].device == "cuda:1" and session["bell"].device == "cpu"
    assert LocalCluster(1, TINY, POOL, segment_tokens=C, kv_dtype="bfloat16", device="cuda").layout.gpus == 1
    pinned = LocalCluster(3, TINY, 3 * POOL, segment_tokens=C, kv_dtype="bfloat16", device="cuda:1")
    assert {pinned.layout.specs("tokenlake-x-", i)["slab"].device for i in range(3)} == {"cuda:1"}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_hold_one_instance_each_and_serve_the_data_plane_scenario():
    """One instance per GPU, peers by message: the same scenario, its partials against
    the float64 reference (``run_iteration``)."""
    from dataclasses import replace

    from test_dataplane import run_iteration

    model = replace(TINY, name="tiny-gpu", head_dim=64)
    with LocalCluster(2, model, 4 * POOL, segment_tokens=C, max_rows=64, kv_dtype="bfloat16",
                      device="cuda") as cluster:
        assert {cluster.slab(0).device.index, cluster.slab(1).device.index} == {0, 1}
        rng = random.Random(1)
        tokens = {"g": [rng.randrange(3, 900) for _ in range(4 * C + 4)]}
        run_iteration(cluster, tokens, {"g": 4 * C + 2}, model=model)
        run_iteration(cluster, tokens, {"g": 1}, model=model)
        cluster.control.finish_request("g")
