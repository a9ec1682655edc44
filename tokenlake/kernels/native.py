"""The native CPU kernels (``csrc/``), built as one torch C++ extension (docs/design.md §4
"Attention backends").

:func:`load` compiles the sources in ``csrc/`` once (``make`` does it when it sets the
virtualenv up; otherwise the first call does) into ``build/native`` beside the checkout,
with torch's own extension builder (g++ and ninja), and returns the module, or None where
it cannot be built (no compiler, an installed package without ``csrc/``).

- :func:`slab_attention` has the contract of
  :func:`tokenlake.kernels.slab.slab_partial_attention` for CPU slabs and is
  tested against the float64 reference (tests/test_native_kernel.py). The query engines
  call it through ``slab_partial_attention`` for few query rows (decode, short chunks)
  where it is built; ``tokenlake bench kernel`` measures it.
- :func:`linear` is ``x @ w.T`` for a few rows of ``x``: the model's projections in a
  decode step (:func:`tokenlake.model.llama.model.linear`; tests/test_native_linear.py).
- :func:`row_ops` offers a decode layer's RMSNorm, RoPE and own-token merge as one call
  each (csrc/row_ops_cpu.cpp; tests/test_native_row_ops.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from tokenlake.kernels.attention import Partial, Tensor

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
SOURCES = tuple(CSRC / f for f in ("module.cpp", "slab_attention_cpu.cpp", "linear_cpu.cpp", "roof_cpu.cpp",
                                         "row_ops_cpu.cpp"))
BUILD_DIR = ROOT / "build" / "native"
NAME = "tokenlake_native_cpu"
FLAGS = ["-O3", "-fopenmp", "-std=c++17"]
#: Beside the built module: the :func:`fingerprint` it was built from.
STAMP = BUILD_DIR / f"{NAME}.fingerprint"
#: Slab dtypes the kernel reads (K/V); q and the results are float32.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_module = None
_tried = False
_prebuilt = None
_prebuilt_tried = False
#: ``TOKENLAKE_ROW_OPS=0``: :func:`row_ops` offers nothing (the torch operations serve), for
#: a process started with it (``tokenlake bench e2e`` with it and without: what they gain).
ROW_OPS_ENV = "TOKENLAKE_ROW_OPS"
#: Whether :func:`row_ops` offers the module (:func:`use_row_ops`).
_row_ops_on = {"on": os.environ.get(ROW_OPS_ENV, "1") != "0"}


#: ``TOKENLAKE_NATIVE_BUILD=0``: :func:`load` never compiles (what ``make`` built from the
#: current sources, else the torch path): a machine that borrows a tree for a short run
#: (a GPU check) need not spend a minute building CPU kernels it does not time.
BUILD_ENV = "TOKENLAKE_NATIVE_BUILD"


def load(verbose: bool = False):
    """The compiled kernel module, building it on first use (unless :data:`BUILD_ENV` is
    ``0``); None if it cannot be built (logged once)."""
    global _module, _tried
    if os.environ.get(BUILD_ENV) == "0":
        return load_prebuilt()
    with _lock:
        if _tried:
            return _module
        _tried = True
        if _prebuilt is not None:
            _module = _prebuilt
            return _module
        if not all(f.is_file() for f in SOURCES):
            log.info("no sources in %s: the native kernels are not available", CSRC)
            return None
        try:
            from torch.utils import cpp_extension

            BUILD_DIR.mkdir(parents=True, exist_ok=True)
            _module = cpp_extension.load(NAME, [str(f) for f in SOURCES], extra_cflags=FLAGS,
                                         extra_include_paths=[str(CSRC)],
                                         build_directory=str(BUILD_DIR), verbose=verbose)
            tmp = STAMP.with_suffix(".tmp")
            tmp.write_text(fingerprint())
            tmp.replace(STAMP)  # atomic: a reader sees the old stamp or the new one
        except Exception as exc:  # a missing compiler or ninja, a failed build
            log.warning("native kernels not built (%s): using the torch path", exc)
            _module = None
        return _module


def fingerprint() -> str:
    """A hash of what a build depends on: every source and header in ``csrc/``, the
    compiler flags and torch's version (a copy that keeps old file times, or a torch
    upgrade, must not pass a stale build as current)."""
    h = hashlib.sha256()
    for f in sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(" ".join(FLAGS).encode() + b"\0" + torch.__version__.encode())
    return h.hexdigest()


def load_prebuilt():
    """The module as ``make`` (or an earlier :func:`load`) built it from the current
    sources (its stamp holds their :func:`fingerprint`), imported directly; None if there
    is none or it is stale. Never compiles: what a query engine and every projection of
    the model call (a build would take most of a minute). The answer is kept, and read
    without the lock once known."""
    global _prebuilt, _prebuilt_tried
    if _module is not None:
        return _module
    if _prebuilt_tried:
        return _prebuilt
    with _lock:
        if _module is not None:
            return _module
        if _prebuilt_tried:
            return _prebuilt
        _prebuilt_tried = True
        so = BUILD_DIR / f"{NAME}.so"
        try:
            current = so.is_file() and CSRC.is_dir() and STAMP.read_text() == fingerprint()
        except OSError:
            current = False
        if not current:
            log.info("no current build of the kernels in %s: the torch path serves", CSRC)
            return None
        try:
            loader = importlib.machinery.ExtensionFileLoader(NAME, str(so))
            spec = importlib.util.spec_from_file_location(NAME, str(so), loader=loader)
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
        except (ImportError, OSError) as exc:
            log.warning("the native kernel in %s does not load (%s): using the torch path", so, exc)
            return None
        _prebuilt = module
        return module


def slab_attention(q: Tensor, slab: Tensor | Sequence[Tensor], layer: int, slots: Sequence[int],
                   tokens: Sequence[int], scale: float, module=None,
                   sources: Sequence[int] | None = None) -> Partial:
    """The kernel's partial attention of ``q`` ``[rows, q_heads, E]`` over the first
    ``tokens[i]`` tokens of ``slots[i]`` of ``layer``: float32 ``o`` and natural-log
    ``lse`` (``-inf`` where no slot has a token). ``slab``: one slab, or several of one
    shape and dtype, slot ``i`` then being in ``slab[sources[i]]`` (one softmax over all
    of them: a query engine's own slab and the co-located peers' it maps). ``module``:
    the loaded kernel to use (default :func:`load`). Raises RuntimeError when the kernel
    is not available and ValueError (from the kernel's checks) for a call that does not
    fit."""
    mod = load() if module is None else module
    if mod is None:
        raise RuntimeError("the native slab attention kernel is not built")
    slabs = [slab] if isinstance(slab, torch.Tensor) else list(slab)
    if sources is None and len(slabs) > 1:
        raise ValueError("several slabs need sources: the slab index of each slot")
    idx = torch.as_tensor(list(slots), dtype=torch.int64)
    cnt = torch.as_tensor(list(tokens), dtype=torch.int64)
    src = torch.zeros_like(idx) if sources is None else torch.as_tensor(list(sources), dtype=torch.int64)
    try:
        o, lse = mod.slab_attention(q.float().contiguous(), slabs, int(layer), idx, cnt, float(scale), src)
    except RuntimeError as exc:  # TORCH_CHECK failures: the call does not fit
        raise ValueError(str(exc).splitlines()[0]) from None
    return Partial(o, lse)


def attention_path(dtype: torch.dtype, grouped_rows: int, head_dim: int, module=None) -> str:
    """The path :func:`slab_attention` takes for K/V of ``dtype`` with ``grouped_rows``
    query rows per kv head (rows x query heads per kv head) and ``head_dim``, with the
    instruction set in use: "tile" (AMX), "dot" (bfloat16 products where allowed:
    :func:`use_bf16_products`), "panel" (many rows otherwise), "vector" or "scalar"
    (csrc/slab_attention_cpu.cpp, csrc/slab_panel.h, csrc/slab_dot.h).
    Raises RuntimeError when the kernel is not available."""
    mod = load() if module is None else module
    if mod is None:
        raise RuntimeError("the native slab attention kernel is not built")
    return mod.attention_path(str(dtype).removeprefix("torch."), int(grouped_rows), int(head_dim))


def use_bf16_products(parts: int, module=None) -> None:
    """Allows bfloat16 products on the kernel's dot path (``parts`` 1 or 2: q in that many
    bfloat16 parts, the probabilities rounded; 0: exact products only, the default) in
    this process (a pool's query engines take ``ClusterConfig.bf16_products``). They
    serve bfloat16 K/V with many grouped rows on CPUs with AVX-512 BF16 and no AMX tiles
    (:func:`attention_path` says "dot"); elsewhere the setting changes nothing. Raises
    RuntimeError when the kernel is not available, ValueError for another ``parts``."""
    if isinstance(parts, bool) or parts not in (0, 1, 2):
        raise ValueError(f"bfloat16 products take q in 1 or 2 parts (0: off), got {parts!r}")
    mod = load() if module is None else module
    if mod is None:
        raise RuntimeError("the native slab attention kernel is not built")
    if parts and (not mod.has_bf16_dots() or mod.isa() != "avx512"):
        log.warning("bfloat16 products change nothing here (isa %s%s): exact products serve",
                    mod.isa(), "" if mod.has_bf16_dots() else ", no AVX-512 BF16")
    mod.set_bf16_products(int(parts))


def use_bf16_products_if_built(parts: int):
    """:func:`use_bf16_products` where the module is built for the current sources
    (never compiles: an engine's start-up, a serving process); returns the module, or
    None (the torch path then serves, with exact products)."""
    mod = load_prebuilt()
    if mod is not None:
        use_bf16_products(parts, module=mod)
    return mod


@contextlib.contextmanager
def bf16_products(parts: int, module=None):
    """:func:`use_bf16_products` for the ``with`` block, then as it was before."""
    mod = load() if module is None else module
    before = 0 if mod is None else mod.bf16_products()
    use_bf16_products(parts, module=mod)
    try:
        yield
    finally:
        mod.set_bf16_products(before)


def use_row_ops(on: bool) -> None:
    """Turns the kernel's RMSNorm, RoPE and own-token merge (:func:`row_ops`) on (the
    default, where it is built) or off (the torch operations; tests and benchmarks
    compare the two)."""
    _row_ops_on["on"] = bool(on)


def row_ops(*tensors: Tensor):
    """The built module if its per-row operations (csrc/row_ops_cpu.cpp) take
    ``tensors`` (contiguous float32 CPU tensors, none recorded by autograd) and they are
    on; else None. Never compiles. A decode layer's RMSNorm, RoPE and own-token merge are
    a few hundred multiply-adds each, which ATen runs as 5-12 operations whose dispatch
    is the cost: one call each here."""
    if not _row_ops_on["on"]:
        return None
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or (
                t.requires_grad and torch.is_grad_enabled()):
            return None
    return load_prebuilt()


def linear(x: Tensor, w: Tensor, module=None) -> Tensor:
    """``x @ w.T`` (``x`` ``[M, K]``, ``w`` ``[N, K]`` contiguous, both float32 on the CPU)
    by the kernel: ``w`` read once per 8 rows of ``x``, each row of the result computed
    from its own row of ``x`` alone. Raises RuntimeError when the kernel is not available
    and ValueError for operands it does not take."""
    mod = load() if module is None else module
    if mod is None:
        raise RuntimeError("the native kernels are not built")
    try:
        return mod.small_linear(x, w)
    except RuntimeError as exc:  # TORCH_CHECK failures
        raise ValueError(str(exc).splitlines()[0]) from None


def roof_stream(buf: Tensor, fmas: int, c: float = 1.0, module=None) -> float:
    """Reads every 64-byte line of ``buf`` once (as 16 floats) and does ``fmas``
    multiply-adds by ``c`` with it, on ATen's threads, prefetching as the attention kernel
    does: the read-rate roof of a kernel doing that arithmetic per line (``tokenlake bench
    kernel``; csrc/roof_cpu.cpp). Returns the sum of the products (``fmas * c`` times
    the sum of ``buf`` read as float32, up to rounding). Raises RuntimeError when the
    kernels are not available and ValueError for a buffer or ``fmas`` it does not take."""
    mod = load() if module is None else module
    if mod is None:
        raise RuntimeError("the native kernels are not built")
    try:
        return mod.roof_stream(buf, int(fmas), float(c))
    except RuntimeError as exc:  # TORCH_CHECK failures
        raise ValueError(str(exc).splitlines()[0]) from None


def machine_info() -> dict[str, object]:
    """What a measurement on this machine depends on: the CPU's model name, the cores
    this process may use, the instruction set the kernels run with (``"none"`` where
    they are not built; never compiles them), whether the CPU has AVX-512 BF16 dot
    products (``bf16_dots``) and this process allows them (``bf16_products``: q's parts,
    0 for exact products)."""
    cpu = "?"
    info = Path("/proc/cpuinfo")
    if info.exists():
        cpu = next((line.split(":", 1)[1].strip() for line in info.read_text().splitlines()
                    if line.startswith("model name")), "?")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
    dots, products = False, 0
    try:
        mod = load_prebuilt()
        isa = "none" if mod is None else mod.isa()
        if mod is not None:
            dots, products = bool(mod.has_bf16_dots()), int(mod.bf16_products())
    except Exception as exc:  # noqa: BLE001 - describing the machine never fails
        isa = f"? ({type(exc).__name__})"
    return {"cpu": cpu, "cores": cores, "isa": isa, "bf16_dots": dots, "bf16_products": products}


def same_machine(a: dict | None, b: dict | None) -> bool:
    """Whether two :func:`machine_info` records name the same CPU model, cores,
    instruction set and bfloat16 products (None, an unrecorded machine, is never the
    same)."""
    keys = ("cpu", "cores", "isa")
    return a is not None and b is not None and all(a.get(k) == b.get(k) for k in keys) and \
        a.get("bf16_products", 0) == b.get("bf16_products", 0)  # not recorded before: 0


if __name__ == "__main__":  # `make` builds the kernels when it sets the virtualenv up
    built = load()
    print("native kernels: " + (f"built ({built.isa()})" if built is not None
                                else "not built (the torch path serves)"))

