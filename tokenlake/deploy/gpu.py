"""What a GPU pool's start-up checks and says about the machine (docs/design.md "GPU path").

An instance's compute, query and transfer engines are three processes on one GPU. Under
NVIDIA's Multi-Process Service (MPS) their kernels share the GPU's multiprocessors at
once, as the paper runs them; without it the driver time-slices the three contexts, so a
query engine's attention waits for the compute engine's kernel in flight (correct, only
slower). :func:`mps_active` looks for the MPS control daemon's pipe; :func:`gpu_setup`
says what the engines will use, and a launcher logs it when it starts a GPU pool.

Importing this module loads no torch (:func:`gpu_setup` imports FlashInfer, and so
torch, where FlashInfer is installed: a GPU pool's process loads them anyway).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path

#: Where the MPS control daemon puts its pipes unless ``CUDA_MPS_PIPE_DIRECTORY`` says.
DEFAULT_MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"


def mps_pipe_directory(env: Mapping[str, str] | None = None) -> Path:
    """The pipe directory a CUDA process of this environment connects to MPS through."""
    env = os.environ if env is None else env
    return Path(env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_MPS_PIPE_DIRECTORY)


def mps_active(env: Mapping[str, str] | None = None) -> bool:
    """Whether an MPS control daemon serves this environment: its ``control`` pipe exists
    (CUDA then runs every process of this user through the MPS server)."""
    return (mps_pipe_directory(env) / "control").exists()


def gpu_setup(env: Mapping[str, str] | None = None) -> dict[str, object]:
    """What a GPU pool runs with here: ``mps`` (bool), ``mps_pipe_directory``,
    ``attention`` (``"flashinfer"`` or ``"torch"``) and a one-line ``summary``."""
    mps = mps_active(env)
    found = importlib.util.find_spec("flashinfer") is not None
    attention = "flashinfer" if found and _imports("flashinfer") else "torch"
    share = ("MPS is active: the engines' kernels share the GPU at once" if mps else
             "MPS is not active: the GPU time-slices the compute, query and transfer engines "
             "(correct, slower; start `nvidia-cuda-mps-control -d` to share it)")
    kernels = ("query engines attend with FlashInfer" if attention == "flashinfer" else
               "FlashInfer is installed but does not import: query engines attend with torch" if found else
               "FlashInfer is not installed: query engines attend with torch "
               "(pip install 'tokenlake[gpu]' for FlashInfer's batched kernels)")
    return {"mps": mps, "mps_pipe_directory": str(mps_pipe_directory(env)),
            "attention": attention, "summary": f"{share}; {kernels}"}


def _imports(name: str) -> bool:
    """Whether module ``name`` imports here, as the engines will import it (a package
    that is installed but broken, a CUDA build for another driver: False)."""
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any failure: the engines fall back the same way
        return False
    return True


def gpus_for(device: str) -> int:
    """How many GPUs a pool on ``device`` spreads its instances over: every GPU this
    process sees for ``"cuda"`` (instance ``i`` on ``cuda:{i % n}``; ``CUDA_VISIBLE_DEVICES``
    chooses them), one for ``"cuda:N"`` (all on that one) and for the CPU. Loads torch
    only for ``"cuda"``."""
    if device != "cuda":
        return 1
    import torch

    return max(1, torch.cuda.device_count())
