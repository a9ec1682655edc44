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


if __name__ == "__main__":
    cfg = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
    kwargs = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
    print(json.dumps(main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), cfg, kwargs)),
          flush=True)
