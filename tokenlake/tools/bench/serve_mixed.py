"""``tokenlake bench serve --mixed N``: N compute engines on the served pool beside the
HTTP load.

Each worker is a process of its own (``python -m tokenlake.tools.bench.serve_worker``,
:class:`~tokenlake.tools.bench.serve_worker.PoolWorker`) with a ``tokenlake.connect``
session on the pool. :class:`MixedWorkers` starts them before the first round and waits
until each has connected; during every measured run against the pool it lets them run
(:meth:`~MixedWorkers.run`) and when the HTTP load ends it pauses them, each finishing
its current iteration (:meth:`~MixedWorkers.pause`), or, with ``iterations`` set, waits
until each has done that many; at the end it collects their reports
(:meth:`~MixedWorkers.finish`). They sit idle while the baseline is measured. Every
start, pause and end is logged (``log``, one line each).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenlake.tools.bench.serve_stats import lost_worker


@dataclass(frozen=True)
class MixedSpec:
    """What ``--mixed`` asks for.

    Attributes:
        workers: compute-engine processes (>= 1).
        iterations: iterations each worker runs per measured pool run (None: as long
            as the HTTP load runs; a worker always finishes the iteration it is in).
        address: the pool's control address ``tcp://HOST:PORT`` (None with ``--launch``:
            the launched pool's).
        credentials: its credentials file (None: where ``tokenlake.connect`` looks).
        ready_timeout_s: seconds a worker may take to connect (it imports torch first).
        pause_timeout_s: seconds to wait for a worker to end its run.
    """

    workers: int
    iterations: int | None = None
    address: str | None = None
    credentials: str | None = None
    ready_timeout_s: float = 120.0
    pause_timeout_s: float = 300.0


def worker_command(address: str, worker: int, seed: int, credentials: str | None) -> list[str]:
    """The command line of worker ``worker`` (seed ``seed`` for its own choices and for
    the document all workers share)."""
    cmd = [sys.executable, "-m", "tokenlake.tools.bench.serve_worker", "--address", address,
           "--worker", str(worker), "--seed", str(seed), "--doc-seed", str(seed)]
    return cmd + (["--credentials", credentials] if credentials else [])


class WorkerProcess:
    """One worker process: JSON events from its stdout, commands to its stdin."""

    def __init__(self, command: list[str], worker: int) -> None:
        self.command, self.worker = command, worker
        self.proc: subprocess.Popen | None = None
        self.dead = False  # its stdout ended
        self._events: queue.Queue = queue.Queue()
        self._stderr = None

    def start(self) -> None:
        self._stderr = tempfile.TemporaryFile(mode="w+b")
        self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, text=True)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        with self.proc.stdout as stream:
            for line in stream:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(event, dict):
                    self._events.put(event)
        self._events.put(None)

    def expect(self, kind: str, timeout_s: float) -> dict | None:
        """The next event of ``kind`` (others are skipped); None if the process ended
        first; TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.dead:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"worker {self.worker}: no {kind!r} after {timeout_s:.0f} s") \
                    from None
            if event is None:
                self.dead = True
            elif event.get("event") == kind:
                return event
        return None

    def send(self, line: str) -> None:
        if self.dead or self.proc.stdin.closed:
            return
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.dead = True

    def end_input(self) -> None:
        try:
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def why(self) -> str:
        """Its exit status (if it ended) and the tail of its stderr."""
        code = self.proc.poll() if self.proc else None
        tail = ""
        if self._stderr is not None:
            self._stderr.flush()
            self._stderr.seek(max(0, self._stderr.seek(0, os.SEEK_END) - 1500))
            tail = self._stderr.read().decode("utf-8", "replace").strip()
        return f"worker {self.worker} ended without a report (exit {code}): {tail}"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ends the process (its input closed, then killed if it lingers)."""
        if self.proc is None:
            return
        self.end_input()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


class MixedWorkers:
    """The ``--mixed`` worker processes of one benchmark (see the module docstring).
    Call :meth:`start`, then :meth:`run` / :meth:`pause` around each measured pool run,
    :meth:`finish` for the reports, and always :meth:`stop`."""

    def __init__(self, spec: MixedSpec, address: str, credentials: str | None, seed: int,
                 log: Callable[[str], None]) -> None:
        self.spec, self.address, self.credentials = spec, address, credentials
        self.seed, self.log = seed, log
        self.procs: list[WorkerProcess] = []
        self.sessions: dict[int, int] = {}

    def start(self) -> None:
        """Starts the workers and waits until each is connected (RuntimeError if one
        ends or times out first)."""
        n = self.spec.workers
        self.log(f"mixed: starting {n} compute engine{'s' * (n > 1)} on {self.address} "
                 "(tokenlake.connect) ...")
        t0 = time.monotonic()
        for i in range(n):
            proc = WorkerProcess(worker_command(self.address, i, self.seed, self.credentials), i)
            self.procs.append(proc)
            proc.start()
        for proc in self.procs:
            try:
                ready = proc.expect("ready", self.spec.ready_timeout_s)
            except TimeoutError as exc:
                raise RuntimeError(f"mixed: {exc}") from None
            if ready is None:
                raise RuntimeError(f"mixed: {proc.why()}")
            self.sessions[proc.worker] = ready["session"]
            s = ready["shape"]
            self.log(f"mixed: worker {proc.worker} ready after {time.monotonic() - t0:.1f} s "
                     f"(session {ready['session']}; {s['num_layers']} layers, "
                     f"{s['num_q_heads']}/{s['num_kv_heads']} heads x {s['head_dim']}, "
                     f"{s['kv_dtype']} KV, C = {ready['segment_tokens']})")

    def run(self) -> None:
        """Lets every worker run (``iterations`` each, or until :meth:`pause`)."""
        k = self.spec.iterations
        self.log(f"mixed: {len(self.procs)} workers run "
                 + (f"{k} iterations each" if k else "while the HTTP load runs"))
        for proc in self.procs:
            proc.send("run" if k is None else f"run {k}")

    def pause(self) -> None:
        """Asks the workers to stop after their current iteration (or, with
        ``iterations``, waits for them to do them all) and waits until each has."""
        if self.spec.iterations is None:
            for proc in self.procs:
                proc.send("pause")
        self.log(f"mixed: waiting for {len(self.procs)} workers to end their "
                 + ("iterations" if self.spec.iterations else "current iteration") + " ...")
        for proc in self.procs:
            try:
                paused = proc.expect("paused", self.spec.pause_timeout_s)
            except TimeoutError as exc:
                self.log(f"mixed: {exc}")
                continue
            if paused is None:
                self.log(f"mixed: {proc.why()}")
            else:
                self.log(f"mixed: worker {proc.worker} paused after "
                         f"{paused['iterations']} iterations")

    def finish(self) -> list[dict]:
        """Ends the workers' input and returns their reports (a worker that gives
        none gets :func:`~tokenlake.tools.bench.serve_stats.lost_worker`'s entry)."""
        for proc in self.procs:
            proc.end_input()
        reports = []
        for proc in self.procs:
            try:
                report = proc.expect("report", self.spec.pause_timeout_s)
            except TimeoutError:
                report = None
            if report is None:
                report = lost_worker(proc.worker, proc.why())
                report["session"] = self.sessions.get(proc.worker)
                self.log(f"mixed: worker {proc.worker} lost: {report['error_samples']}")
            else:
                report.pop("event", None)
                self.log(f"mixed: worker {proc.worker} done: {report['iterations']} "
                         f"iterations, {report['wrong_answers']} wrong, "
                         f"{report['errors']} errors")
            reports.append(report)
        return reports

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()
