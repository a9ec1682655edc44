"""vLLM in a process of its own (vLLM starts engine processes: a script needs the
``__main__`` guard): ``python vllm_worker.py MODEL_DIR PROMPTS_JSON MAX_TOKENS
[KV_TRANSFER_CONFIG_JSON [LLM_KWARGS_JSON]]`` prints one JSON line ``{"outputs": [[token
ids], ...]}`` with the greedy outputs of the prompts (lists of token ids)."""

from __future__ import annotations

import json
import sys


def main(model_dir: str, prompts: list[list[int]], max_tokens: int, kv_config: dict | None,
         kwargs: dict | None = None) -> dict:
    from vllm import LLM, SamplingParams

    extra = {"kv_transfer_config": kv_config} if kv_config else {}
    extra.update(kwargs or {})
    llm = LLM(model=model_dir, dtype="float32", max_model_len=4096, enforce_eager=True,
              gpu_memory_utilization=0.3, kv_cache_memory_bytes=256 << 20, seed=0, **extra)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return {"outputs": [list(o.outputs[0].token_ids) for o in outs]}


def connector_config(address: str, **extra) -> dict:
    """The KV-transfer config of the TokenLake connector on the pool at ``address``."""
    return {"kv_connector": "TokenLakeConnector",
            "kv_connector_module_path": "tokenlake.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"address": address, **extra}}


def run(model_dir, prompts, max_tokens, kv_config=None, kwargs=None):
    """This script in a process of its own: ``(outputs, stderr)``; asserts it succeeded."""
    import subprocess

    args = [sys.executable, __file__, str(model_dir), json.dumps(prompts), str(max_tokens),
            json.dumps(kv_config), json.dumps(kwargs)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith('{"outputs"')]
    return json.loads(line)["outputs"], done.stderr


if __name__ == "__main__":
    cfg = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
    kwargs = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
    print(json.dumps(main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), cfg, kwargs)),
          flush=True)
