"""A compute engine in a process of its own, driving a served pool through
``tokenlake.connect`` (run by tests/test_service.py; prints one JSON line).

    python service_worker.py ADDRESS REQUEST_ID PROMPT_SEED SHARED_TOKENS

It prefills one prompt: the first ``SHARED_TOKENS`` tokens come from a document every
worker shares, the rest from ``PROMPT_SEED``. The cached prefix is looked up first
(``get_prefix_tree().match``) and declared; the new tokens' K/V go in through the
worker's own data-plane client; each layer's partial attention over the prefix is
compared with the float64 reference. Prints ``{"hit_tokens", "worst", "stored"}``.
"""

from __future__ import annotations

import json
import random
import sys

import torch
from dataplane_util import execute, full_attention_check, reference_prefix

import tokenlake
from tokenlake.core.plans import Batch, BatchRequest

DOC_SEED = 11


def prompt_of(prompt_seed: int, shared: int, length: int) -> list[int]:
    doc = random.Random(DOC_SEED)
    own = random.Random(prompt_seed)
    return [doc.randrange(3, 900) for _ in range(shared)] + [
        own.randrange(3, 900) for _ in range(length - shared)]


def main(address: str, request_id: str, prompt_seed: int, shared: int) -> dict:
    tokens = {request_id: prompt_of(prompt_seed, shared, shared + 13)}
    prompt = tokens[request_id]
    with tokenlake.connect(address, timeout_s=20.0) as cp:
        hit = cp.get_prefix_tree().match(prompt, max_tokens=len(prompt) - 1).hit_tokens
        request = BatchRequest(request_id, tuple(prompt[hit:]), tuple(prompt[:hit]))
        plans = cp.gen_plans([Batch((request,))], [1])
        try:
            results = execute(cp, plans, tokens, {request_id: len(prompt) - hit})
        except BaseException:
            cp.abort(plans)
            raise
        cp.complete(plans)
        worst = 0.0
        for (_rid, _pos, layer), (q, o, lse, span) in results.items():
            if span.prefix_tokens == 0:
                assert torch.isinf(lse).all() and (lse < 0).all()
                continue
            ro, rlse = reference_prefix(prompt, span.prefix_tokens, q, layer)
            worst = max(worst, (o.double() - ro).abs().max().item(),
                        (lse.double() - rlse).abs().max().item(),
                        *full_attention_check(prompt, span, q, o, lse, layer))
        cp.finish_request(request_id)
        stored = cp.get_prefix_tree().match(prompt).hit_tokens
    return {"hit_tokens": hit, "worst": worst, "stored": stored}


if __name__ == "__main__":
    address, rid, seed, shared = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(main(address, rid, seed, shared)))
