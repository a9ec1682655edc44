"""A compute engine in a process of its own on a served pool shared with other clients
(run by tests/test_shared_pool.py; prints JSON lines).

    python shared_pool_worker.py ADDRESS MODEL_JSON SEED ITERATIONS [victim]

``run`` (the default): iterations of requests named ``r0``, ``r1``, ... (the same names
in every worker: each session has its own namespace), each a prompt that starts with a
document all workers share (0 to 3 segments of it) followed by tokens of its own,
prefilled in one iteration and then decoded a few tokens, one iteration each. Every
layer's partial attention over the pool is compared with the float64 reference of the
K/V the prompt's tokens stand for (tests/dataplane_util.py). A request whose segment
another client is still storing (``SegmentInFlight``) waits and is planned again.
Prints ``{"iterations", "worst", "waits", "session"}``.

``victim [TOKENS_JSON]``: stores a document of its own (or these tokens), and in the
middle of that iteration (half its layers put, its plans in flight) prints ``{"ready":
true, "session", "keys", "slots"}`` and waits to be killed.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time

import torch
from dataplane_util import execute, reference_prefix, token_kv

import tokenlake
from tokenlake.core.errors import SegmentInFlight
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.core.specs import ModelSpec

DOC_SEED = 5


def plan(cp, batch: Batch) -> tuple:
    """``gen_plans`` of one batch, waiting while another client stores a segment it
    completes (at most 60 s); returns ``(plans, waits)``."""
    deadline, waits = time.monotonic() + 60.0, 0
    while True:
        try:
            return cp.gen_plans([batch], [1]), waits
        except SegmentInFlight:
            if time.monotonic() > deadline:
                raise
            waits += 1
            time.sleep(0.01)  # the other client's iteration completes or is aborted


def check(results, prompt: list[int], spec: ModelSpec) -> float:
    """The largest difference of the pool's partials from the float64 reference."""
    worst = 0.0
    for (_rid, _pos, layer), (q, o, lse, span) in results.items():
        if span.prefix_tokens == 0:
            assert torch.isinf(lse).all() and (lse < 0).all()
            continue
        ro, rlse = reference_prefix(prompt, span.prefix_tokens, q, layer, spec)
        worst = max(worst, (o.double() - ro).abs().max().item(), (lse.double() - rlse).abs().max().item())
    return worst


def iteration(cp, batch: Batch, prompt: list[int], new: int, spec: ModelSpec) -> tuple[float, int]:
    """Plans, runs and completes one iteration of the batch's one request (whose tokens
    so far are ``prompt``, the last ``new`` of them computed now); returns its largest
    difference from the reference and how often it waited for a segment in flight."""
    plans, waits = plan(cp, batch)
    rid = batch.requests[0].request_id
    try:
        results = execute(cp, plans, {rid: prompt}, {rid: new}, model=spec)
    except BaseException:
        cp.abort(plans)
        raise
    cp.complete(plans)
    return check(results, prompt, spec), waits


def run(address: str, spec: ModelSpec, seed: int, iterations: int) -> dict:
    rng = random.Random(seed)
    c = 16
    doc = [random.Random(DOC_SEED).randrange(3, spec.vocab_size) for _ in range(3 * c)]
    done = waits = 0
    worst = 0.0
    with tokenlake.connect(address, timeout_s=30.0, label=f"worker-{seed}") as cp:
        r = 0
        while done < iterations:
            rid = f"r{r}"
            r += 1
            prompt = doc[: rng.choice((0, c, 2 * c, 3 * c))] + [rng.randrange(3, spec.vocab_size)
                                                                  for _ in range(rng.randrange(3, 2 * c))]
            hit = cp.get_prefix_tree().match(prompt, max_tokens=len(prompt) - 1).hit_tokens
            batch = Batch((BatchRequest(rid, tuple(prompt[hit:]), tuple(prompt[:hit])),))
            err, w = iteration(cp, batch, prompt, len(prompt) - hit, spec)
            worst, waits, done = max(worst, err), waits + w, done + 1
            for _ in range(rng.randrange(1, 4)):
                prompt.append(rng.randrange(3, spec.vocab_size))
                err, w = iteration(cp, Batch((BatchRequest(rid, (prompt[-1],)),), "decode"), prompt, 1, spec)
                worst, waits, done = max(worst, err), waits + w, done + 1
            cp.finish_request(rid)
        session = cp.session.session
        bells = sorted(i for i, c in cp._clients.items() if c._bell is not None)  # hand-offs in shared memory
    return {"iterations": done, "worst": worst, "waits": waits, "session": session, "bells": bells}


def victim(address: str, spec: ModelSpec, seed: int, prompt: list[int] | None = None) -> None:
    rng = random.Random(seed)
    if prompt is None:
        prompt = [rng.randrange(3, spec.vocab_size) for _ in range(3 * 16 + 5)]
    cp = tokenlake.connect(address, timeout_s=30.0, label="victim")
    plans = cp.gen_plans([Batch((BatchRequest("r0", tuple(prompt)),))], [1])
    (qp,), (tp,) = plans.query_plans, plans.transfer_plans
    client = cp.client(qp.home)
    kv = client.init_transfer(tp)
    client.init_query(qp)
    for layer in range(spec.num_layers // 2):  # half the layers stored: mid-iteration
        kv[layer] = token_kv(prompt, 0, layer, spec)
        client.put(layer).wait()
    keys = [p.key.hex() for p in tp.puts if p.key is not None]
    slots = [[p.instance, p.slot] for p in tp.puts]
    print(json.dumps({"ready": True, "session": cp.session.session, "keys": keys, "slots": slots}),
          flush=True)
    threading.Event().wait()  # until killed


def reuse(address: str, spec: ModelSpec, seed: int) -> dict:
    """Stores the victim's document (which must not be cached: its storing was
    aborted), then reads it back as the prefix of another request, exactly."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, spec.vocab_size) for _ in range(3 * 16 + 5)]
    with tokenlake.connect(address, timeout_s=30.0, label="reuse") as cp:
        first_hit = cp.get_prefix_tree().match(prompt, max_tokens=len(prompt) - 1).hit_tokens
        iteration(cp, Batch((BatchRequest("a", tuple(prompt)),)), prompt, len(prompt), spec)
        cp.finish_request("a")
        second = prompt[:48] + [7, 8, 9]
        hit = cp.get_prefix_tree().match(second, max_tokens=len(second) - 1).hit_tokens
        batch = Batch((BatchRequest("b", tuple(second[hit:]), tuple(second[:hit])),))
        worst, _ = iteration(cp, batch, second, len(second) - hit, spec)
        cp.finish_request("b")
    return {"iterations": 2, "worst": worst, "first_hit": first_hit, "hit": hit}


if __name__ == "__main__":
    address, model, seed, iterations = sys.argv[1], ModelSpec(**json.loads(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4])
    if sys.argv[5:6] == ["victim"]:
        victim(address, model, seed, json.loads(sys.argv[6]) if sys.argv[6:] else None)
    elif sys.argv[5:] == ["reuse"]:
        print(json.dumps(reuse(address, model, seed)), flush=True)
    else:
        print(json.dumps(run(address, model, seed, iterations)), flush=True)
