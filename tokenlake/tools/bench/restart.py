"""``tokenlake bench restart``: how soon a ``tokenlake serve`` killed with ``kill -9``
serves again when its pool outlives it, against a cold start (docs/design.md §4
"Restart").

Each round runs both modes, alternately, on fresh ports:

* ``adopt``: ``tokenlake serve --json`` (the pool's default sizes unless
  ``instances``/``pool_mb`` are given; ``--orphan-grace-s`` of the run) is started, asked
  question A about the demo document (which stores it) and question B (whose cached
  tokens are recorded), killed with SIGKILL, and started again with the same settings
  and ports: it adopts the waiting engines;
* ``cold``: the same with ``--orphan-grace-s 0`` for the first process (the engines die
  with it; the restart waits until they are gone), so the restart starts empty.

Per restart: ``restart_to_ready_s`` (from the new process's spawn to its ``ready``
event), ``restart_to_first_cached_answer_s`` (from the spawn to the end of the answer
to question B, the ready time included), that answer's cached tokens
(``usage.prompt_tokens_details.cached_tokens``), whether its text equals the answer
before the kill, and ``restored`` (the ready event's segments restored; ``None``: it
started empty). The restarted process is then stopped with SIGTERM. ``cold`` also
records ``engines_gone_after_kill_s``: how long its engines took to end after the kill.

Every process runs with a private ``TOKENLAKE_HOME`` (a temporary folder) and without
the user's ``TOKENLAKE_*`` settings (defaults and flags only). Every process started is
stopped whatever happens; after each round every engine the pool's state file named
must be gone: one still running (and mapping its cluster's buffers) is killed, its
buffers unlinked, and both are reported (``leftover_engines``, ``leftover_buffers``), as
are the state and credentials files of the round's port still in the home
(``leftover_files``: none when the pool cleaned up after itself).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path

from tokenlake.dataplane import pool_state
from tokenlake.dataplane.shm_files import (
    cluster_prefix,
    list_buffers,
    mapped_buffers,
    pid_alive,
    unlink_prefix,
)
from tokenlake.tools.bench.serve_load import LaunchedServer, sigterm_as_interrupt
from tokenlake.tools.config import CONFIG_ENV, ServeSettings, env_var

MODES = ("adopt", "cold")
METRICS = ("restart_to_ready_s", "restart_to_first_cached_answer_s")
#: question A stores the document, question B is measured (before the kill and after)
QUESTIONS = ("Who is it about?", "What happened?")
ENGINES_GONE_S = 30.0  # how long engines may take to end after their owner stopped


@dataclass(frozen=True)
class RestartConfig:
    """What ``tokenlake bench restart`` runs (``None`` sizes: serve's defaults)."""

    rounds: int = 3
    instances: int | None = None
    pool_mb: int | None = None
    orphan_grace_s: float = 60.0
    max_tokens: int = 8
    start_timeout_s: float = 300.0
    document_copies: int = 1  # the demo document this many times over: a longer prefix

    def settings(self) -> dict:
        """The settings as run: the sizes serve chose where none was given."""
        defaults = {f.name: f.default for f in fields(ServeSettings)}
        return {**asdict(self), "instances": self.instances or defaults["instances"],
                "pool_mb": self.pool_mb or defaults["pool_mb"],
                "default_sizes": self.instances is None and self.pool_mb is None,
                "segment_tokens": defaults["segment_tokens"], "model": defaults["model"]}


class _Serve(LaunchedServer):
    """A :class:`LaunchedServer` with its own environment (the private home)."""

    def __init__(self, command: list[str], name: str, env: dict[str, str]) -> None:
        super().__init__(command, name, stop_timeout_s=60.0)
        self.env = env

    def start(self) -> None:
        self._stderr = tempfile.TemporaryFile(mode="w+b")
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=self._stderr,
                                     stdin=subprocess.DEVNULL, text=True, env=self.env)
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True).start()

    def kill(self) -> None:
        """SIGKILL, as an OOM kill or a crash would end it."""
        self.proc.kill()
        self.proc.wait()
        self.stop()  # closes its stderr file


def free_ports(n: int = 2) -> tuple[int, ...]:
    """``n`` different ports free now, outside the kernel's ephemeral range: the serve
    process binds its engines to ephemeral ports before its control and HTTP ports, and
    one of them could otherwise take a number picked here. Each is held until all are
    picked, so no two are the same."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for _ in range(200 * n):
            port = rng.randrange(max(1024, low - 12000), low)
            s = held.enter_context(socket.socket())
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == n:
                return tuple(ports)
    raise RuntimeError("no free port below the ephemeral range")


def _document(copies: int = 1) -> str:
    """The demo document (about 440 tokens), ``copies`` times over."""
    text = resources.files("tokenlake.data").joinpath("demo_document.txt").read_text(encoding="utf-8")
    return "\n\n".join([text] * copies)


def serve_env(home: Path) -> dict[str, str]:
    """This process's environment without the serve settings' variables and the config
    file's, with ``TOKENLAKE_HOME`` = ``home``."""
    drop = {env_var(f.name) for f in fields(ServeSettings)} | {CONFIG_ENV}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "TOKENLAKE_HOME": str(home)}


def serve_command(config: RestartConfig, control: int, http: int, grace: float) -> list[str]:
    """``tokenlake serve --json`` on these ports with this grace (sizes only if given)."""
    sizes = [*(["--instances", str(config.instances)] if config.instances else []),
             *(["--pool-mb", str(config.pool_mb)] if config.pool_mb else [])]
    return [sys.executable, "-m", "tokenlake.tools.cli", "serve", "--json", *sizes,
            "--control-port", str(control), "--http-port", str(http),
            "--orphan-grace-s", f"{grace:g}"]


def ask(url: str, model: str, question: str, max_tokens: int, copies: int = 1) -> tuple[str, int]:
    """``(text, cached tokens)`` of one greedy completion about the demo document
    (``copies`` times over)."""
    body = json.dumps({"model": model, "prompt": f"{_document(copies)}\n\nQuestion: {question}\nAnswer:",
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as exc:  # e.g. a pool too small for the document
        raise RuntimeError(f"{url}/v1/completions: HTTP {exc.code}: "
                           f"{exc.read().decode('utf-8', 'replace')[:300]}") from None
    details = answer["usage"].get("prompt_tokens_details") or {}
    return answer["choices"][0]["text"], int(details.get("cached_tokens") or 0)


class _Engines:
    """The engines of the pools served on one control port (read from its state file),
    and the leftovers: what still runs after its owner stopped."""

    def __init__(self, home: Path, control: int) -> None:
        self.home, self.control, self.path = home, control, home / f"pool-{control}.json"
        self.pids: dict[int, str] = {}  # pid: its cluster id
        self.clusters: list[str] = []

    def remember(self) -> None:
        state = pool_state.read(self.path)
        if state is None:
            return
        if state["cluster_id"] not in self.clusters:
            self.clusters.append(state["cluster_id"])
        self.pids.update({int(pid): state["cluster_id"] for _, _, pid, _ in state["engines"]})

    def alive(self) -> list[int]:
        return sorted(p for p, cid in self.pids.items()
                      if pid_alive(p) and mapped_buffers(cluster_prefix(cid), [p]))

    def wait_gone(self, timeout_s: float) -> list[int]:
        """Waits until none runs; the pids still running after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left

    def reap(self, timeout_s: float = ENGINES_GONE_S) -> dict:
        """Kills the engines that outlived their owner and unlinks their buffers."""
        self.remember()  # a state file still there (its owner failed) may name more
        left = self.wait_gone(timeout_s)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(pid, signal.SIGKILL)
        buffers = [n for cid in self.clusters for n in list_buffers(cluster_prefix(cid))]
        for cid in self.clusters:
            unlink_prefix(cluster_prefix(cid))
        files = sorted(p.name for p in self.home.glob(f"*-{self.control}.json"))
        return {"leftover_engines": left, "leftover_buffers": buffers, "leftover_files": files}


def _first_serve(stack: ExitStack, config: RestartConfig, ports: tuple[int, int], grace: float,
                 env: dict[str, str], engines: _Engines) -> tuple[_Serve, str, int]:
    """Starts the pool that will be killed, caches the document; ``(serve, text of
    question B, its cached tokens)``."""
    first = _Serve(serve_command(config, *ports, grace), "first serve", env)
    stack.callback(first.stop)
    first.start()
    first.wait_ready(config.start_timeout_s)
    engines.remember()
    model = first.ready_event.get("model", "smollm2-135m")
    ask(first.url, model, QUESTIONS[0], config.max_tokens, config.document_copies)
    text, cached = ask(first.url, model, QUESTIONS[1], config.max_tokens, config.document_copies)
    return first, text, cached


def _restart(stack: ExitStack, config: RestartConfig, ports: tuple[int, int], grace: float,
             env: dict[str, str], engines: _Engines) -> dict:
    """Starts the second serve and times it to ready and to the answer of question B."""
    t0 = time.perf_counter()
    second = _Serve(serve_command(config, *ports, grace), "restarted serve", env)
    stack.callback(second.stop)
    second.start()
    second.wait_ready(config.start_timeout_s)
    ready_s = time.perf_counter() - t0
    engines.remember()
    text, cached = ask(second.url, second.ready_event.get("model", "smollm2-135m"),
                       QUESTIONS[1], config.max_tokens, config.document_copies)
    answer_s = time.perf_counter() - t0
    return {"restart_to_ready_s": ready_s, "restart_to_first_cached_answer_s": answer_s,
            "cached_tokens": cached, "text": text, "restored": second.ready_event.get("restored"),
            "exit_code": second.stop()}


def run_round(config: RestartConfig, mode: str, home: Path, progress: Callable[[str], None]) -> dict:
    """One mode's kill and restart on fresh ports; its raw figures."""
    ports = free_ports(2)
    grace = config.orphan_grace_s if mode == "adopt" else 0.0
    engines = _Engines(home, ports[0])
    env = serve_env(home)
    try:
        with ExitStack() as stack:
            progress(f"{mode}: starting serve (grace {grace:g} s) and caching the document ...")
            first, before, cached_before = _first_serve(stack, config, ports, grace, env, engines)
            first.kill()
            killed = time.perf_counter()
            if mode == "cold":  # today's behaviour: the engines are gone before the restart
                engines.wait_gone(ENGINES_GONE_S)
            gone_s = time.perf_counter() - killed if mode == "cold" else None
            progress(f"{mode}: killed with SIGKILL; restarting ...")
            after = _restart(stack, config, ports, grace, env, engines)
    finally:
        clean = engines.reap()
    same = after.pop("text") == before
    progress(f"{mode}: ready after {after['restart_to_ready_s']:.1f} s, answered after "
             f"{after['restart_to_first_cached_answer_s']:.1f} s, {after['cached_tokens']} cached tokens")
    return {"mode": mode, "grace_s": grace, **after, "cached_tokens_before_kill": cached_before,
            "same_text": same, "engines_gone_after_kill_s": gone_s,
            "cluster_ids": engines.clusters, "engine_pids": sorted(engines.pids), **clean}


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(rounds: list[dict]) -> dict:
    """``summary``, ``ratios`` (cold median / adopt median) and ``cached_tokens`` of the
    rounds' raw figures."""
    by_mode = {m: [r for r in rounds if r["mode"] == m] for m in MODES}
    summary = {m: {k: _stats([r[k] for r in rs]) for k in METRICS} for m, rs in by_mode.items()}
    ratios = {k.removesuffix("_s"): summary["cold"][k]["median"] / summary["adopt"][k]["median"]
              for k in METRICS}
    cached = {m: {"before_kill": [r["cached_tokens_before_kill"] for r in rs],
                  "after_restart": [r["cached_tokens"] for r in rs],
                  "same_text": all(r["same_text"] for r in rs)} for m, rs in by_mode.items()}
    return {"summary": summary, "ratios": ratios, "cached_tokens": cached}


def _isa() -> str | None:
    """The instruction set the csrc kernels use here (as ``bench kernel`` reports it)."""
    from tokenlake.kernels import native  # torch: only for this line of the report

    mod = native.load()
    return None if mod is None else mod.isa()


def bench_restart(config: RestartConfig, progress: Callable[[str], None] = lambda line: None) -> dict:
    """The JSON of ``tokenlake bench restart`` (module docstring)."""
    rounds = []
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="tokenlake-bench-restart-") as home:
        sigterm_as_interrupt(stack)  # SIGTERM unwinds too: every process is stopped
        for r in range(config.rounds):
            progress(f"round {r + 1}/{config.rounds}")
            for mode in MODES if r % 2 == 0 else MODES[::-1]:  # alternating: no mode always first
                rounds.append({"round": r, **run_round(config, mode, Path(home), progress)})
    return {"isa": _isa(), "settings": config.settings(), "rounds": rounds, **summarize(rounds)}


def print_report(result: dict) -> None:
    """The summary of :func:`bench_restart`'s result as a short table."""
    s, summary, cached = result["settings"], result["summary"], result["cached_tokens"]
    sizes = "default sizes" if s["default_sizes"] else "sizes given"
    print(f"tokenlake serve killed (SIGKILL) and restarted: {s['instances']} instances x "
          f"{s['pool_mb']} MiB ({sizes}), {s['rounds']} round(s), median [min, max]; isa {result['isa']}")
    print(f"{'':34s}{'adopt (grace ' + format(s['orphan_grace_s'], 'g') + ' s)':>24s}"
          f"{'cold (grace 0)':>24s}{'cold/adopt':>12s}")
    for metric in METRICS:
        cells = [f"{x['median']:.2f} s [{x['min']:.2f}, {x['max']:.2f}]"
                 for x in (summary["adopt"][metric], summary["cold"][metric])]
        ratio = result["ratios"][metric.removesuffix("_s")]
        print(f"{metric.removesuffix('_s').replace('_', ' '):34s}{cells[0]:>24s}{cells[1]:>24s}{ratio:>11.2f}x")
    for key in ("before_kill", "after_restart"):
        cells = [", ".join(map(str, cached[m][key])) for m in MODES]
        print(f"{'cached tokens ' + key.replace('_', ' '):34s}{cells[0]:>24s}{cells[1]:>24s}")
    same = ["yes" if cached[m]["same_text"] else "NO" for m in MODES]
    print(f"{'same answer after the restart':34s}{same[0]:>24s}{same[1]:>24s}")
