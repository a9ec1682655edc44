"""vLLM in a process of its own: ``python vllm_worker.py MODEL_DIR PROMPTS_JSON MAX_TOKENS
[KV_TRANSFER_CONFIG_JSON [LLM_KWARGS_JSON]]`` prints one JSON line ``{"outputs": [[token
ids], ...]}`` with the greedy outputs of the prompts (lists of token ids).

``python vllm_worker.py --serve FD MODEL_DIR KV_TRANSFER_CONFIG_JSON LLM_KWARGS_JSON``
keeps one engine for many requests (:class:`Worker`): each line on stdin (``{"prompts":
..., "max_tokens": N}``) is answered by one JSON line on file descriptor FD; vLLM's own
output goes to stdout and stderr. A vLLM engine takes ~30 s to start on 2 cores, so a
test module keeps its engines instead of starting one per question.

A :class:`Worker` runs vLLM in one process (:data:`IN_PROCESS_ENV`,
:data:`IN_PROCESS_KWARGS`): the engine core and the model's worker in the process that
calls ``LLM``, not in two more that each import vLLM again (half the start-up time, and
nothing to reap but the one process). The TokenLake connector's scheduler side and
worker side are then two connector objects in that process, joining one pool session as
they do from two processes. vLLM's multi-process engine (``vllm serve``) runs in
tests/test_vllm_query.py's OpenAI-server test."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile

#: vLLM's engine core in the process that calls ``LLM`` (``InprocClient``), not a process
#: of its own; with :data:`IN_PROCESS_KWARGS`, the model's worker too.
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
IN_PROCESS_KWARGS = {"distributed_executor_backend": "uni"}


def _llm(model_dir: str, kv_config: dict | None, kwargs: dict | None):
    from vllm import LLM

    extra = {"kv_transfer_config": kv_config} if kv_config else {}
    extra.update(kwargs or {})
    return LLM(model=model_dir, dtype="float32", max_model_len=4096, enforce_eager=True,
               gpu_memory_utilization=0.3, kv_cache_memory_bytes=256 << 20, seed=0, **extra)


def _generate(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return {"outputs": [list(o.outputs[0].token_ids) for o in outs]}


def main(model_dir: str, prompts: list[list[int]], max_tokens: int, kv_config: dict | None,
         kwargs: dict | None = None) -> dict:
    return _generate(_llm(model_dir, kv_config, kwargs), prompts, max_tokens)


def serve(fd: int, model_dir: str, kv_config: dict | None, kwargs: dict | None) -> None:
    """The ``--serve`` loop: a request per stdin line, its answer on ``fd``."""
    llm = _llm(model_dir, kv_config, kwargs)
    with os.fdopen(fd, "w") as answers:
        answers.write('{"ready": true}\n')
        answers.flush()
        for line in sys.stdin:
            req = json.loads(line)
            answers.write(json.dumps(_generate(llm, req["prompts"], req["max_tokens"])) + "\n")
            answers.flush()
    llm.llm_engine.engine_core.shutdown()  # the connector's sides close their pool session
    # Nothing is left to release: vLLM has shut down (its engine processes too, if it
    # had any) and its connector's pool sessions are closed. The interpreter's own
    # teardown (collecting vLLM's and torch's modules) would take ~5 s more on 2 cores;
    # the process ends without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def workers(*specs: dict):
    """:class:`Worker` s started side by side (``Worker(**spec)`` each), ready; all closed
    on the way out, and each must have shut down cleanly (exit status 0)."""
    started: list[Worker] = []
    try:
        for spec in specs:
            started.append(Worker(**spec))
        yield [w.wait_ready() for w in started]
    finally:
        for w in started:  # all shut down side by side
            w.end_input()
        status = [w.close() for w in started]
    for w, code in zip(started, status):
        assert code == 0, f"a vLLM worker did not shut down cleanly (exit {code}): {w.log()[-4000:]}"


class Worker:
    """A vLLM engine kept in a process of its own for many requests (``--serve``), with
    ``env`` added to its environment; the whole engine in that one process unless
    ``in_process`` is false. :meth:`run` returns ``(outputs, log)``: the greedy outputs
    and what vLLM (and the connector in it) logged while it ran."""

    def __init__(self, model_dir, log_path, kv_config=None, kwargs=None, env=None,
                 in_process: bool = True) -> None:
        read, write = os.pipe()
        self._tmp = tempfile.mkdtemp(prefix="tokenlake-vllm-")
        self.log_path = str(log_path)
        self._log = open(self.log_path, "wb")
        if in_process:
            env, kwargs = {**IN_PROCESS_ENV, **(env or {})}, {**IN_PROCESS_KWARGS, **(kwargs or {})}
        args = [sys.executable, __file__, "--serve", str(write), str(model_dir),
                json.dumps(kv_config), json.dumps(kwargs)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=self._log,
                                     stderr=subprocess.STDOUT, pass_fds=(write,),
                                     # vLLM's rendezvous file (and IPC sockets) in a
                                     # directory of its own, removed by close()
                                     env={**os.environ, "TMPDIR": self._tmp, **(env or {})},
                                     start_new_session=True)
        os.close(write)
        self._answers = os.fdopen(read, "r")

    def wait_ready(self, timeout_s: float = 400.0) -> Worker:
        assert self._next(timeout_s) == {"ready": True}
        return self

    def _next(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self._answers], [], [], timeout_s)
        line = self._answers.readline() if ready else ""
        assert line, f"the vLLM worker gave no answer (exit {self.proc.poll()}): {self.log()[-4000:]}"
        return json.loads(line)

    def log(self, start: int = 0) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")

    def run(self, prompts, max_tokens, timeout_s: float = 300.0):
        start = os.path.getsize(self.log_path)
        self.proc.stdin.write((json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n").encode())
        self.proc.stdin.flush()
        outputs = self._next(timeout_s)["outputs"]
        return outputs, self.log(start)

    def close(self) -> int:
        """Ends the engine and returns its exit status: end of input first (vLLM shuts
        down, the connector closes its pool sessions), a kill of its whole process group
        (vLLM's engine processes too, if any) if it has not exited within 60 s."""
        self.end_input()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        from tokenlake.tools.bench.vllm import end_group

        end_group(self.proc.pid)  # an engine process it left behind
        self._answers.close()
        self._log.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
        return self.proc.returncode

    def end_input(self) -> None:
        """No more requests: the engine shuts down (:meth:`close` waits for it)."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()


def reference_outputs(ref, prefix: list[int], tails: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The reference engine's greedy outputs (``max_tokens`` each, no stop token) of the
    prompts ``prefix + tail``, one per tail: the prefix is prefilled once and each tail
    runs after a copy of its K/V, as after a prefix-cache hit, instead of every prompt
    from scratch (the prefix is most of each prompt, and most of the reference's time)."""
    from tokenlake.model.llama.reference import KVCache, greedy

    _, cache = ref.prefill(prefix)
    outputs = []
    for tail in tails:
        own = KVCache([k.clone() for k in cache.keys], [v.clone() for v in cache.values], cache.length)
        logits, out = ref.extend(own, tail), []
        while True:
            out.append(greedy(logits))
            if len(out) == max_tokens:
                break
            logits = ref.decode_step(own, out[-1])
        outputs.append(out)
    return outputs


def connector_config(address: str, **extra) -> dict:
    """The KV-transfer config of the TokenLake connector on the pool at ``address``."""
    return {"kv_connector": "TokenLakeConnector",
            "kv_connector_module_path": "tokenlake.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"address": address, **extra}}


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    serve(int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5]))
elif __name__ == "__main__":
    cfg = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
    kwargs = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
    print(json.dumps(main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), cfg, kwargs)),
          flush=True)
