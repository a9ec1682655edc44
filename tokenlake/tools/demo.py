"""``make demo`` / ``tokenlake demo``: SmolLM2-135M served through a 4-instance pool.

A long shared system prompt, one shared document asked several questions (LooGLE-like)
and a two-turn session. Every attention over a cached prefix is computed by the
instances that hold it; the compute engine keeps no KV between iterations. Each answer
is checked token for token against a plain engine with a local KV cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib import resources

from tokenlake.core.placement import coefficient_of_variation
from tokenlake.deploy.local import LocalCluster
from tokenlake.generation import GenerationLoop, GenerationRequest
from tokenlake.generation.live import one_per_phase

SYSTEM = (
    "You are the reading assistant of the Port Veldon town library. You answer questions about "
    "documents that visitors bring to the desk. Read the document carefully before you answer. "
    "Answer in one or two short sentences, use only facts that the document states, and say "
    "plainly when the document does not contain the answer. Do not invent names, dates or "
    "numbers, do not give opinions, and do not repeat the question. When a question asks for a "
    "number, give the number with its unit. When a question asks for a name, give the full name "
    "as the document writes it. Be polite and brief."
)
QUESTIONS = [
    "How tall is the Harbor Lighthouse?",
    "Who was the first keeper of the lighthouse?",
    "What color does the light flash today?",
    "When is the Lantern Festival held?",
]
SESSION = ["In what year was the tower finished?", "And how many steps does it have?"]


@dataclass(frozen=True)
class DemoConfig:
    instances: int = 4
    segment_tokens: int = 64
    pool_mib_per_instance: int = 96
    max_new_tokens: int = 24
    kv_dtype: str = "float32"  # the pool's K/V (the reference engine's cache: the same)
    device: str = "cpu"  # "cuda": model and pool on the GPU, the model's matrices in kv_dtype


def _document() -> str:
    return resources.files("tokenlake.data").joinpath("demo_document.txt").read_text(encoding="utf-8")


def _ask(history: list[dict], question: str, doc: str, first: bool) -> list[dict]:
    content = f"Document:\n{doc}\n\nQuestion: {question}" if first else question
    return history + [{"role": "user", "content": content}]


def run_demo(config: DemoConfig = DemoConfig(), progress=print) -> dict:
    """Serves the workload, checks it against the reference engine, returns the report."""
    # Imported here: loading the model pulls torch, which `tokenlake --help` must not.
    from tokenlake.model.llama.tokenizer import load_tokenizer
    from tokenlake.model.llama.weights import load_weights

    t0 = time.monotonic()
    weights, tok = load_weights().for_pool(config.device, config.kv_dtype), load_tokenizer()
    spec = weights.config.to_model_spec("smollm2-135m")  # the reference below: the same weights
    with LocalCluster(config.instances, spec, config.pool_mib_per_instance << 20,
                      segment_tokens=config.segment_tokens, kv_dtype=config.kv_dtype,
                      device=config.device) as cluster:
        server = GenerationLoop(cluster, weights)
        prompts = _serve_workload(server, tok, config)
        stats = cluster.control.stats()
        page_tokens = cluster.control.config.page_tokens
        results = server.results
        schedule = _schedule_summary(server)
    progress(f"served {len(results)} requests through {config.instances} instances "
             f"in {time.monotonic() - t0:.1f} s; checking against the reference engine ...")
    report_requests = _check_against_reference(weights, tok, results, prompts, config)
    pool = stats.pool
    return {
        "reference_match": all(r["matches_reference"] or r["near_tie"] for r in report_requests),
        "requests": report_requests,
        "instances": [{"instance": i, "segments": pool.slots_used[i], "accesses": pool.reads[i]}
                      for i in sorted(pool.slots_used)],
        "cv": coefficient_of_variation([pool.reads[i] for i in sorted(pool.reads)]),
        "hit_rate": stats.hit_rate,
        "segment_tokens": config.segment_tokens,
        "page_tokens": page_tokens,
        "kv_dtype": config.kv_dtype,
        "device": _device_name(config.device),
        "scheduler": schedule,
        "wall_s": time.monotonic() - t0,
    }


def _device_name(device: str) -> str:
    """``device``, with the GPU's name for a CUDA one (what a report's figures ran on)."""
    if device == "cpu":
        return device
    import torch

    return f"{device} ({torch.cuda.get_device_name(device)})"


def _serve_workload(server: GenerationLoop, tok, config: DemoConfig) -> dict[str, tuple[int, ...]]:
    """Runs the three waves of the demo; returns each request's prompt token ids."""
    doc = _document()
    system = [{"role": "system", "content": SYSTEM}]
    prompts: dict[str, tuple[int, ...]] = {}

    def serve(wave: dict[str, list[dict]]) -> None:
        reqs = []
        for rid, messages in wave.items():
            prompts[rid] = tuple(tok.apply_chat_template(messages))
            reqs.append(GenerationRequest(rid, prompts[rid], config.max_new_tokens, (tok.eos_id,)))
        server.run(reqs)

    # Wave 1: the first question puts the system prompt and the document into the pool.
    serve({"q0": _ask(system, QUESTIONS[0], doc, True)})
    # Wave 2: the other questions and the session's first turn reuse them.
    wave = {f"q{i}": _ask(system, q, doc, True) for i, q in enumerate(QUESTIONS[1:], 1)}
    wave["s0"] = _ask(system, SESSION[0], doc, True)
    serve(wave)
    # Wave 3: the session's second turn reuses its whole history.
    answer = tok.decode([t for t in server.results["s0"].output_ids if t != tok.eos_id])
    serve({"s1": _ask(wave["s0"] + [{"role": "assistant", "content": answer}], SESSION[1], doc, False)})
    return prompts


def _schedule_summary(server: GenerationLoop) -> dict:
    """What ran: iterations, prefill batches per DoP, decode batches (the policy's
    batches, joined per phase as one local engine runs them)."""
    batches = [b for d in server.decisions
               for b in (d.batches if server.parallel else one_per_phase(d.batches))]
    prefill_dops = sorted({b.dop for b in batches if b.phase == "prefill"})
    return {
        "policy": server.policy.name,
        "iterations": server.iterations,
        "prefill_batches_by_dop": {str(k): sum(1 for b in batches if b.phase == "prefill" and b.dop == k)
                                   for k in prefill_dops},
        "decode_batches": sum(1 for b in batches if b.phase == "decode"),
    }


def _check_against_reference(weights, tok, results, prompts, config: DemoConfig) -> list[dict]:
    """One report row per request, with whether its output equals the plain engine's."""
    # Imported here for the same reason as the model above (torch).
    import torch

    from tokenlake.model.llama.reference import ReferenceEngine

    ref = ReferenceEngine(weights, getattr(torch, config.kv_dtype))
    rows = []
    for rid, res in results.items():
        run = ref.generate(list(prompts[rid]), config.max_new_tokens, stop_ids=(tok.eos_id,))
        expected = run.output_ids
        rows.append({
            "request_id": rid,
            "prompt_token_ids": list(prompts[rid]),
            "output_token_ids": res.output_ids,
            "hit_tokens": res.hit_tokens,
            "prompt_tokens": len(prompts[rid]),
            "answer": tok.decode([t for t in res.output_ids if t != tok.eos_id]).strip(),
            "matches_reference": list(expected) == res.output_ids,
            "near_tie": _near_tie(run, res.output_ids, config.kv_dtype),
        })
    return rows


def _near_tie(run, output_ids: list[int], kv_dtype: str) -> dict | None:
    """Where a half-precision pool's output first leaves the reference's: the step and
    the reference's margin between its token and the pool's, if that margin is at most
    twice :data:`~tokenlake.model.llama.reference.LOGIT_TOLERANCE` (a near tie, which the
    two engines' roundings may decide either way); None if the outputs are equal, the
    pool is float32, or the margin is larger (a real difference)."""
    from tokenlake.model.llama.reference import LOGIT_TOLERANCE

    step = next((i for i, (a, b) in enumerate(zip(run.output_ids, output_ids)) if a != b), None)
    if step is None or kv_dtype == "float32":
        return None
    logits = run.logits[step]
    margin = float(logits[run.output_ids[step]] - logits[output_ids[step]])
    tolerance = LOGIT_TOLERANCE[kv_dtype]
    return {"step": step, "margin": margin, "tolerance": 2 * tolerance} if margin <= 2 * tolerance else None


def print_report(report: dict) -> None:
    print()
    for r in report["requests"]:
        tie = r.get("near_tie")
        mark = "ok" if r["matches_reference"] else (
            f"leaves the reference at a near tie: token {tie['step']}, margin {tie['margin']:.3f} "
            f"<= {report['kv_dtype']} tolerance {tie['tolerance']}" if tie else "DIFFERS FROM REFERENCE")
        print(f"[{r['request_id']}] hit {r['hit_tokens']:>4} of {r['prompt_tokens']:>4} prompt tokens  ({mark})")
        print(f"      {r['answer']}")
    print()
    print("instance  segments  cache accesses")
    for i in report["instances"]:
        print(f"{i['instance']:>8}  {i['segments']:>8}  {i['accesses']:>14}")
    print(f"\naccess-load CV {report['cv']:.1%}   hit rate {report['hit_rate']:.1%}   "
          f"C = {report['segment_tokens']} tokens, hits exact to {report['page_tokens']}, "
          f"{report['kv_dtype']} KV, on {report['device']}   "
          f"{report['wall_s']:.1f} s")
    sch = report["scheduler"]
    dops = ", ".join(f"DoP {k}: {n}" for k, n in sch["prefill_batches_by_dop"].items())
    print(f"scheduler {sch['policy']}: {sch['iterations']} iterations; prefill batches {dops}; "
          f"decode batches {sch['decode_batches']}")
    ties = sum(1 for r in report["requests"] if not r["matches_reference"])
    verdict = (f"every answer equals the reference engine's greedy output ({report['kv_dtype']} "
               "KV cache)" + (f", {ties} up to a near tie" if ties else "")) if report["reference_match"] \
        else "SOME ANSWERS DIFFER FROM THE REFERENCE ENGINE"
    print(verdict)
