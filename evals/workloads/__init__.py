"""Workloads for the evaluation harness: one :class:`Request` type for all of them.

=====================  ==============================================================
name                   source
=====================  ==============================================================
``sharegpt``           :func:`load_sharegpt` -- packaged ShareGPT chats + long system
                       prompt, multi-turn sessions
``loogle``             :func:`load_loogle` -- a LooGLE jsonl file (``path``)
``loogle-synthetic``   :func:`synthetic_loogle` -- LooGLE-shaped random tokens
``scbench``            :func:`load_scbench` -- an SCBench jsonl file (``path``, ``mode``)
``scbench-synthetic``  :func:`synthetic_scbench` -- SCBench-shaped random tokens
``mooncake``           :func:`load_mooncake` -- a Mooncake FAST'25 trace (``path``)
=====================  ==============================================================

:func:`load_workload` picks one by name (for command lines). Every loader returns a
:class:`RequestList` sorted by arrival and is deterministic under its ``seed``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from evals.workloads.arrivals import (
    mean_rate,
    poisson_arrivals,
    retime,
    scale_rate,
    with_poisson_arrivals,
    with_session_arrivals,
)
from evals.workloads.base import Request, RequestList, Workload, check_requests
from evals.workloads.loogle import load_loogle, read_loogle, synthetic_loogle
from evals.workloads.mooncake import load_mooncake, prefix_reuse, repeat_trace
from evals.workloads.scbench import load_scbench, read_scbench, synthetic_scbench
from evals.workloads.sharegpt import (
    JsonArrayStream,
    conversation_turns,
    load_sharegpt,
    sharegpt_path,
)
from evals.workloads.text import WhitespaceTokenizer, resolve_tokenizer

WORKLOADS: dict[str, Callable[..., RequestList]] = {
    "sharegpt": load_sharegpt,
    "loogle": load_loogle,
    "loogle-synthetic": synthetic_loogle,
    "scbench": load_scbench,
    "scbench-synthetic": synthetic_scbench,
    "mooncake": load_mooncake,
}


def load_workload(name: str, **options: Any) -> RequestList:
    """The workload called ``name`` (a key of :data:`WORKLOADS`), built with
    ``options`` (the keyword arguments of its loader; file loaders need ``path``)."""
    try:
        loader = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None
    params = inspect.signature(loader).parameters
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise ValueError(f"workload {name!r} has no option(s) {unknown}; "
                         f"it takes {', '.join(params)}")
    missing = [p.name for p in params.values()
               if p.default is inspect.Parameter.empty and p.name not in options]
    if missing:
        raise ValueError(f"workload {name!r} needs {', '.join(missing)}")
    return loader(**options)


__all__ = [
    "JsonArrayStream",
    "Request",
    "RequestList",
    "WORKLOADS",
    "WhitespaceTokenizer",
    "Workload",
    "check_requests",
    "conversation_turns",
    "load_loogle",
    "load_mooncake",
    "load_scbench",
    "load_sharegpt",
    "load_workload",
    "mean_rate",
    "poisson_arrivals",
    "prefix_reuse",
    "read_loogle",
    "read_scbench",
    "repeat_trace",
    "resolve_tokenizer",
    "retime",
    "scale_rate",
    "sharegpt_path",
    "synthetic_loogle",
    "synthetic_scbench",
    "with_poisson_arrivals",
    "with_session_arrivals",
]
