"""``tokenlake threshold``, ``fit-roofline``, ``profile-cpu`` and ``profile-latency``: the
cost model's numbers, from the shipped profiles or measured on this machine.

The formulas live in :mod:`tokenlake.core.cost_model` (pure functions); this module only
parses arguments, calls them and writes the JSON documents committed under
``tokenlake/data/``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tokenlake.core.cost_model import (
    LatencyModel,
    comm_overhead_s,
    default_segment_tokens,
    fit_report,
    roofline_samples,
    segment_threshold,
)
from tokenlake.core.specs import list_hardware, list_models, load_hardware, load_model
from tokenlake.tools import latency_profile, profiler
from tokenlake.tools.cli.args import at_least, output_file, positive


def register(sub: argparse._SubParsersAction) -> None:
    """Adds the cost-model and profiling commands to the command tree."""
    add_threshold(sub.add_parser(
        "threshold", help="segment-size threshold for a model and hardware (paper §4.2)",
        description="The smallest segment size C (tokens) for which querying a remote "
                    "segment saves as much compute as the communication costs (JSON)."))
    add_fit_roofline(sub.add_parser(
        "fit-roofline", help="fit the scheduler's latency model to roofline samples",
        description="Fits a LatencyModel to synthetic roofline samples of a model on a "
                    "hardware profile and writes the JSON document shipped under "
                    "tokenlake/data/latency/."))
    add_profile_cpu(sub.add_parser(
        "profile-cpu", help="measure this machine (writes a hardware entry)",
        description="Measures memory bandwidth, matmul FLOP/s and instance-to-instance "
                    "transfer on this machine and writes them as a hardware profile (JSON)."))
    add_profile_latency(sub.add_parser(
        "profile-latency", help="measure the compute engine, fit the scheduler's latency model",
        description="Times batches of the real CPU compute engine through a local pool "
                    "(SmolLM2-135M) and fits the scheduler's latency model to them (JSON)."))


def _model_and_hardware(p: argparse.ArgumentParser, model: str | None,
                        hardware: str | None) -> None:
    """``--model`` and ``--hardware`` among the shipped names (required where no default)."""
    p.add_argument("--model", default=model, required=model is None, choices=list_models(),
                   help="model spec (tokenlake/data/models.json)")
    p.add_argument("--hardware", default=hardware, required=hardware is None,
                   choices=list_hardware(), help="hardware profile (tokenlake/data/hardware.json)")


# --------------------------------------------------------------------------- threshold


def add_threshold(p: argparse.ArgumentParser) -> None:
    _model_and_hardware(p, "llama-2-7b", "a100-80gb")
    p.set_defaults(run=run_threshold)


def run_threshold(args: argparse.Namespace) -> int:
    spec, hw = load_model(args.model), load_hardware(args.hardware)
    print(json.dumps({"threshold_tokens": segment_threshold(spec, hw),
                      "default_segment_tokens": default_segment_tokens(spec, hw),
                      "comm_overhead_us": comm_overhead_s(spec, hw) * 1e6}, indent=2))
    return 0


# --------------------------------------------------------------------------- fit-roofline


def add_fit_roofline(p: argparse.ArgumentParser) -> None:
    _model_and_hardware(p, None, None)
    p.add_argument("--out", required=True, type=output_file, help="JSON file to write")
    p.add_argument("--samples", type=at_least(int, 6), default=500,
                   help="roofline samples to fit")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled batches")
    p.add_argument("--max-context", type=positive(int), default=None,
                   help="longest context sampled, tokens (default: the model's)")
    p.set_defaults(run=run_fit_roofline)


def roofline_document(hardware: str, model: str, n_samples: int, seed: int,
                      max_context: int | None, command: str) -> dict[str, Any]:
    """Fits a :class:`LatencyModel` to roofline samples; the JSON document to commit."""
    spec, hw = load_model(model), load_hardware(hardware)
    samples = roofline_samples(spec, hw, n_samples=n_samples, seed=seed, max_context=max_context)
    fitted = LatencyModel.fit(samples)
    return {
        "hardware": hardware,
        "model": model,
        "source": "roofline_samples (synthetic), not measurements",
        "max_context": max_context or spec.max_context,
        "coefficients": fitted.to_dict(),
        "fit": fit_report(fitted, samples),
        "generated_by": command,
    }


def run_fit_roofline(args: argparse.Namespace) -> int:
    doc = roofline_document(args.hardware, args.model, args.samples, args.seed,
                            args.max_context, args.command_line)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")
    print(json.dumps(doc["fit"], indent=2))
    return 0


# --------------------------------------------------------------------------- profile-cpu


def add_profile_cpu(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=output_file, help="JSON file to write")
    p.add_argument("--merge", action="store_true",
                   help="update the entry in an existing hardware table instead of overwriting")
    p.add_argument("--name", default="cpu", help="name of the profile entry")
    p.add_argument("--transfer", default="auto", choices=("auto", "zmq", "memcpy"),
                   help="how instance-to-instance transfer is measured (auto: zmq if importable)")
    p.set_defaults(run=run_profile_cpu)


def run_profile_cpu(args: argparse.Namespace) -> int:
    profile = profiler.profile_cpu(transfer=args.transfer, name=args.name)
    profiler.write_profile(profile, args.out, args.merge)
    print(json.dumps(profile.to_dict(), indent=2))
    return 0


# --------------------------------------------------------------------------- profile-latency


def add_profile_latency(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=output_file, help="JSON file to write")
    p.add_argument("--samples", type=at_least(int, 6), default=60, help="batches to measure")
    p.add_argument("--instances", type=positive(int), default=2, help="pool instances")
    p.add_argument("--max-prefix", type=positive(int), default=4096,
                   help="longest cached prefix sampled, tokens")
    p.add_argument("--segment-tokens", type=positive(int), default=None,
                   help="tokens per segment (default: the §4.2 rule on the cpu profile)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled batches")
    extra = p.add_mutually_exclusive_group()
    extra.add_argument("--dop-speedup", action="store_true",
                       help="only measure the speed-up of a prefill at DoP 1..--instances on one compute "
                            "engine per instance and add it to the existing --out file")
    extra.add_argument("--query-engine", action="store_true",
                       help="only measure what a query message costs a query engine (with the "
                            "existing --out file's coefficients) and add it to that file")
    p.set_defaults(run=run_profile_latency)


def run_profile_latency(args: argparse.Namespace) -> int:
    def progress(i: int, n: int) -> None:
        print(f"\rsample {i}/{n}", end="", file=sys.stderr, flush=True)

    if args.dop_speedup or args.query_engine:
        try:
            with open(args.out, encoding="utf-8") as fh:
                doc = json.load(fh)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"tokenlake profile-latency: error: --dop-speedup and --query-engine add "
                             f"to an existing profile; cannot read {args.out}: {exc}") from None
        seg = args.segment_tokens or doc.get("setup", {}).get("segment_tokens")
        if args.dop_speedup:
            key, got = "dop_speedup", latency_profile.measure_dop_speedup(
                args.instances, segment_tokens=seg, seed=args.seed, progress=progress)
        else:
            key, got = "query_engine", latency_profile.measure_query_engine(
                doc["coefficients"], args.instances, segment_tokens=seg, seed=args.seed, progress=progress)
        doc.update(got)
        print(file=sys.stderr)
        doc[f"{key}_generated_by"] = args.command_line
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1)
            fh.write("\n")
        print(json.dumps({key: doc[key]}, indent=2))
        return 0
    doc = latency_profile.profile(args.samples, args.instances, args.max_prefix,
                                  args.segment_tokens, args.seed, progress=progress)
    print(file=sys.stderr)
    doc["generated_by"] = args.command_line
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    print(json.dumps({"coefficients": doc["coefficients"], "fit": doc["fit"]}, indent=2))
    return 0
