"""What ``tokenlake bench serve`` sends and to whom: the workloads as prompts of token
ids, and the ``tokenlake serve`` processes that ``--launch`` starts and stops.

Workloads come from :mod:`evals.workloads`:

* ``loogle``: :func:`~evals.workloads.synthetic_loogle` sized for a small model on a
  few CPU cores (documents of ``doc_tokens`` random tokens, ``questions_per_doc``
  questions each sharing the document as an exact prefix, documents interleaved);
* ``sharegpt``: :func:`~evals.workloads.load_sharegpt` (the packaged chats, SmolLM2
  tokens, a shared filler system prompt whose text depends on the seed);
* ``mooncake``: :func:`~evals.workloads.load_mooncake` on a trace file, each 512-token
  block scaled down to ``block_tokens`` stand-in tokens so prompts fit a small model.

Every prompt is cut to ``max_prompt_tokens`` and every output to ``max_tokens``; token
ids stay in ``[17, vocab_size)`` (above SmolLM2's control tokens). Different seeds give
prompts that share nothing, so each round of a comparison starts with a cold cache.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from tokenlake.tools.interrupt import sigterm_raises

WORKLOAD_NAMES = ("loogle", "sharegpt", "mooncake")
RESERVED_IDS = 17  # SmolLM2's control tokens: never sent as prompt tokens
_MIX = 2654435761  # Knuth's multiplicative hash constant


@dataclass(frozen=True)
class BenchRequest:
    """One request as sent: its id, the prompt's token ids and the output length."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class WorkloadSpec:
    """How to build the prompts of one run (see the module docstring)."""

    name: str = "loogle"
    num_requests: int = 32
    max_tokens: int = 16
    max_prompt_tokens: int = 2048
    vocab_size: int = 49152
    doc_tokens: int = 1500
    questions_per_doc: int = 4
    system_prompt_tokens: int = 500
    trace: str | None = None
    block_tokens: int = 16


def block_tokens(block_id: int, n: int, vocab_size: int) -> list[int]:
    """``n`` stand-in token ids of trace block ``block_id``: equal ids give equal tokens,
    all in ``[RESERVED_IDS, vocab_size)``, scrambled so neighbouring blocks differ."""
    span = vocab_size - RESERVED_IDS
    base = block_id * 1_000_003
    return [RESERVED_IDS + ((base + i) * _MIX % 2**32) % span for i in range(n)]


def _cap(reqs, spec: WorkloadSpec, prompt_of) -> list[BenchRequest]:
    out = []
    for r in reqs:
        prompt = tuple(prompt_of(r))[: spec.max_prompt_tokens]
        out.append(BenchRequest(r.request_id, prompt, max(1, min(r.output_length,
                                                                 spec.max_tokens))))
    return out


def _mooncake(spec: WorkloadSpec, seed_round: int) -> list[BenchRequest]:
    from evals.workloads import load_mooncake

    trace = load_mooncake(spec.trace, n=spec.num_requests).items
    # round r offsets every block id past the trace's largest: nothing is shared across
    # rounds, as if each round replayed a fresh trace of the same shape
    stride = 1 + max(h for r in trace for h in r.block_hashes)
    scale = spec.block_tokens / trace[0].block_size

    def prompt_of(r) -> list[int]:
        want = min(spec.max_prompt_tokens, max(1, round(r.input_length * scale)))
        ids: list[int] = []
        for h in r.block_hashes:
            if len(ids) >= want:
                break
            ids += block_tokens(h + seed_round * stride, spec.block_tokens, spec.vocab_size)
        return ids[:want]

    return _cap(trace, spec, prompt_of)


def build_workload(spec: WorkloadSpec, seed: int) -> list[BenchRequest]:
    """The ``spec.num_requests`` requests of one run in send order, deterministic under
    ``seed``. ValueError (or FileNotFoundError) on impossible options."""
    if spec.name == "loogle":
        from evals.workloads import synthetic_loogle

        q = spec.questions_per_doc
        reqs = synthetic_loogle(spec.num_requests, seed=seed, doc_tokens=spec.doc_tokens,
                                doc_spread=0.1, questions=(q, q), question_tokens=(16, 48),
                                answer_tokens=(spec.max_tokens, spec.max_tokens),
                                vocab_size=spec.vocab_size).items
        # Questions about a document arrive over time, not all at once: send the first
        # question of every document, then the second, ... (ids are loogle-syn-D-qJ).
        order = sorted(range(len(reqs)), key=lambda i: (
            int(reqs[i].request_id.rsplit("-q", 1)[1]), i))
        return _cap([reqs[i] for i in order], spec, lambda r: r.token_ids)
    if spec.name == "sharegpt":
        from evals.workloads import load_sharegpt

        reqs = load_sharegpt(n=spec.num_requests, seed=seed,
                             system_prompt_tokens=spec.system_prompt_tokens,
                             max_input_len=spec.max_prompt_tokens,
                             max_output_len=spec.max_tokens,
                             max_conversations=max(500, 20 * spec.num_requests)).items
        return _cap(reqs, spec, lambda r: r.token_ids)
    if spec.name == "mooncake":
        if not spec.trace:
            raise ValueError("the mooncake workload needs a trace file")
        return _mooncake(spec, seed)
    raise ValueError(f"unknown workload {spec.name!r}; known: {', '.join(WORKLOAD_NAMES)}")


def warmup_requests(n: int, spec: WorkloadSpec, seed: int) -> list[BenchRequest]:
    """``n`` short prompts of random tokens sharing nothing with any workload prompt:
    they start the server's model and paths without warming its cache."""
    import random

    rng = random.Random(f"tokenlake-bench-serve-warmup-{seed}")
    length = min(128, spec.max_prompt_tokens)
    return [BenchRequest(f"warmup-{i}", tuple(rng.randrange(RESERVED_IDS, spec.vocab_size)
                                              for _ in range(length)), spec.max_tokens)
            for i in range(n)]


# --------------------------------------------------------------------------- --launch


def parse_ready_line(line: str) -> str | None:
    """The ``http_url`` of a ``tokenlake serve --json`` line that announces readiness;
    None for any other line (other events, log text). A ready event without an
    ``http_url`` raises RuntimeError (a server without the HTTP front end)."""
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(event, dict) or event.get("event") != "ready":
        return None
    url = event.get("http_url")
    if not isinstance(url, str) or not url.startswith("http"):
        raise RuntimeError(f"'tokenlake serve' is ready but announces no http_url: {line.strip()}")
    return url.rstrip("/")


def serve_command(engine: str, instances: int, extra: Sequence[str] = ()) -> list[str]:
    """The command line of one ``tokenlake serve`` with an HTTP front end on a free port."""
    return [sys.executable, "-m", "tokenlake.tools.cli", "serve", "--json", "--http-port", "0",
            "--control-port", "0", "--engine", engine, "--instances", str(instances), *extra]


class LaunchedServer:
    """One ``tokenlake serve`` process: :meth:`start` it, :meth:`wait_ready` for its URL
    (its whole ready event is kept in ``ready_event``: the control ``address`` and
    ``credentials`` file too), and always :meth:`stop` it (SIGTERM, then kill after
    ``stop_timeout_s``)."""

    def __init__(self, command: Sequence[str], name: str, stop_timeout_s: float = 60.0) -> None:
        self.command, self.name, self.stop_timeout_s = list(command), name, stop_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.ready_event: dict = {}
        self._lines: queue.Queue = queue.Queue()
        self._stderr: Any = None

    def start(self) -> None:
        self._stderr = tempfile.TemporaryFile(mode="w+b")
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=self._stderr,
                                     stdin=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True).start()

    def _pump(self, stream) -> None:
        # drains stdout for the whole life of the process so it never blocks on a full pipe
        with stream:
            for line in stream:
                self._lines.put(line)
        self._lines.put(None)

    def stderr_tail(self, chars: int = 2000) -> str:
        if self._stderr is None:
            return ""
        self._stderr.flush()
        self._stderr.seek(0, os.SEEK_END)
        size = self._stderr.tell()
        self._stderr.seek(max(0, size - chars))
        return self._stderr.read().decode("utf-8", "replace").strip()

    def wait_ready(self, timeout_s: float) -> str:
        """Reads events until the ready line; RuntimeError if the process ends first or
        ``timeout_s`` passes."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(0.0, left))
            except queue.Empty:
                raise RuntimeError(f"{self.name}: not ready after {timeout_s:.0f} s") from None
            if line is None:
                raise RuntimeError(f"{self.name}: 'tokenlake serve' ended before it was ready "
                                   f"(exit {self.proc.wait()}): {self.stderr_tail()}")
            url = parse_ready_line(line)
            if url is not None:
                self.url, self.ready_event = url, json.loads(line)
                return url

    def stop(self) -> int | None:
        """SIGTERM, wait, kill if it lingers; the exit code (None if never started)."""
        if self.proc is None:
            return None
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            return self.proc.returncode
        except BaseException:  # a second Ctrl-C while waiting: leave no orphan behind
            self.proc.kill()
            self.proc.wait()
            raise
        finally:  # stdout is closed by the pump thread at its end
            if self._stderr is not None:
                self._stderr.close()
                self._stderr = None


def launch_servers(stack: ExitStack, instances: int, extra: list[str],
                   timeout_s: float) -> dict[str, LaunchedServer]:
    """Starts ``tokenlake serve`` with the pool engine and with the reference engine
    (both at once), registers their stop on ``stack`` first, and returns them ready
    (``"pool"``, ``"baseline"``)."""
    servers = {"pool": LaunchedServer(serve_command("pool", instances, extra), "pool"),
               "baseline": LaunchedServer(serve_command("reference", instances, extra),
                                          "baseline")}
    for server in servers.values():
        stack.callback(server.stop)
        server.start()
    for server in servers.values():
        server.wait_ready(timeout_s)
    return servers


def sigterm_as_interrupt(stack: ExitStack) -> None:
    """While ``stack`` is open, SIGTERM unwinds like Ctrl-C, so launched servers stop
    (:mod:`tokenlake.tools.interrupt`; the command line does it for every command, this
    for a benchmark called from Python)."""
    restore = sigterm_raises()
    if restore is not None:
        stack.callback(restore)
