"""``tokenlake demo``, ``tokenlake walkthrough`` and ``tokenlake serve``: the pool at work.

Each command is an ``add_*`` function that registers its arguments on the one tree
(:mod:`tokenlake.tools.cli`) and a ``run_*`` function that runs the parsed arguments
and returns the exit code. Nothing heavy is imported until a command runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import threading
from dataclasses import replace
from typing import Any

from tokenlake.core.control import KV_DTYPES
from tokenlake.core.errors import TokenLakeError
from tokenlake.core.specs import load_model
from tokenlake.tools import walkthrough
from tokenlake.tools.cli import config as cli_config
from tokenlake.tools.cli.args import UsageError, check_device, device_name, positive
from tokenlake.tools.config import configure_logging


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``demo``, ``walkthrough`` and ``serve`` to the command tree."""
    add_demo(sub.add_parser(
        "demo", help="SmolLM2-135M served through a local pool, checked against a plain engine",
        description="SmolLM2-135M served through a local pool; every answer is checked token "
                    "for token against a plain engine. Exit code 0 when every answer matches, "
                    "1 when one differs (a wrong answer, not a usage mistake)."))
    add_walkthrough(sub.add_parser(
        "walkthrough", help="control-plane walk-through (LooGLE-like workload, no model)",
        description="A LooGLE-like workload through the control plane alone, with and without "
                    "heavy-hitter replication: hit rate, deduplication, per-instance reads."))
    add_serve(sub.add_parser(
        "serve", help="serve the pool (control port, OpenAI-compatible HTTP API) until Ctrl-C",
        description="Starts the pool (on this machine; on a Ray cluster with --ray, "
                    "docs/deploy-ray.md) with its control port (what tokenlake.connect() "
                    "takes) and, for smollm2-135m, an OpenAI-compatible HTTP API with "
                    "/metrics; prints both addresses and serves until Ctrl-C or SIGTERM "
                    "(exit 0; 130 for Ctrl-C during start-up). "
                    "Settings: defaults < --config FILE < TOKENLAKE_* environment < flags "
                    "('tokenlake config show' prints them)."))


# --------------------------------------------------------------------------- demo


def add_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=positive(int), default=4, help="pool instances")
    p.add_argument("--kv-dtype", default="float32", choices=tuple(KV_DTYPES),
                   help="element type of the pool's K/V (the reference engine's cache: the same)")
    p.add_argument("--device", default="cpu", type=device_name,
                   help="'cuda' (the instances spread over the visible GPUs) or 'cuda:N': the model and "
                        "the pool on the GPU (needs --kv-dtype "
                        "bfloat16 or float16, which the model's matrices take too)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    """0 when every answer equals the reference engine's, 1 when one differs."""
    # torch and the model load only when the demo runs, not for --help
    from tokenlake.tools.demo import DemoConfig, print_report, run_demo

    check_device(args.device, "demo", args.kv_dtype)
    report = run_demo(DemoConfig(instances=args.instances, kv_dtype=args.kv_dtype, device=args.device),
                      progress=(lambda *_: None) if args.json else print)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report["reference_match"] else 1


# --------------------------------------------------------------------------- walkthrough


def add_walkthrough(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=positive(int), default=8, help="pool instances")
    p.add_argument("--requests", type=positive(int), default=400, help="requests to serve")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")
    p.add_argument("--json", action="store_true", help="print the two runs as JSON")
    p.set_defaults(run=run_walkthrough)


def run_walkthrough(args: argparse.Namespace) -> int:
    workload = replace(walkthrough.WorkloadConfig(), num_requests=args.requests, seed=args.seed)
    results = [walkthrough.run(args.instances, replication=rep, workload=workload)
               for rep in (False, True)]
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        walkthrough.print_report(results, workload, args.instances)
    return 0


# --------------------------------------------------------------------------- serve


def add_serve(p: argparse.ArgumentParser) -> None:
    # the settings' flags (model, sizes, ports, Ray, log level): tokenlake/tools/config.py
    cli_config.add_settings_flags(p)
    p.add_argument("--json", action="store_true", help="one JSON object per event")
    p.set_defaults(run=run_serve)


def tier_settings(cfg) -> dict[str, Any]:
    """The ``ClusterConfig`` tier fields of ``tokenlake serve``'s settings (local or Ray)."""
    return {"tier_bytes": cfg.tier_mb << 20, "tier_path": cfg.tier_path,
            "tier_write_bw": cfg.tier_write_mbps << 20}


def run_serve(args: argparse.Namespace) -> int:
    """Runs until Ctrl-C or SIGTERM; a cluster that cannot start is a one-line error (2)."""
    cfg = cli_config.settings_from_args(args).settings
    configure_logging(cfg.log_level)
    if cfg.device != "cpu":
        if cfg.ray_address is not None:
            raise UsageError(f"serve --ray: --device {cfg.device} serves without --ray only (a Ray "
                             "cluster of GPU instances has not run yet)")
        if cfg.kv_layout != "tokenlake":
            raise UsageError(f"serve: --kv-layout {cfg.kv_layout} is vLLM's KV for its CPU build: "
                             f"--device {cfg.device} serves --kv-layout tokenlake only")
    if cfg.ray_address is None:
        return _serve_local(cfg, args.json)
    if importlib.util.find_spec("ray") is None:
        raise UsageError("serve needs Ray: pip install 'tokenlake[ray]'")
    if cfg.engine != "pool":
        raise UsageError(f"serve --ray: --engine {cfg.engine} serves without --ray only")
    if cfg.kv_layout != "tokenlake":
        raise UsageError(f"serve --ray: --kv-layout {cfg.kv_layout} serves without --ray only")
    # Ray is an optional extra, and heavy: only this command imports it
    from tokenlake.deploy.ray import RayOptions, serve

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)  # a service manager's stop: shut down cleanly too
    from tokenlake.dataplane import pool_state

    # a pool on a control port of its own is named after it: a new driver on that port
    # adopts what a dead one left on Ray (docs/deploy-ray.md "When the driver dies")
    state_file = str(pool_state.path_for(cfg.control_port)) if cfg.control_port else None
    options = RayOptions(
        strategy=cfg.ray_strategy, cpus_per_instance=cfg.ray_cpus_per_instance,
        gpus_per_instance=cfg.ray_gpus_per_instance, engine_share=cfg.ray_engine_share,
        place_timeout_s=cfg.ray_place_timeout_s,
        host=cfg.bind, port_range=cfg.ports, insecure=cfg.insecure,
        address=None if cfg.ray_address == "local" else cfg.ray_address,
        name=f"serve-{cfg.control_port}" if state_file else None, orphan_grace_s=cfg.orphan_grace_s,
    )
    try:
        return serve(cfg.instances, cfg.model, cfg.pool_mb << 20, options, cfg.segment_tokens,
                     cfg.max_rows, restart=cfg.restart, json_lines=args.json,
                     page_tokens=cfg.page_tokens, kv_dtype=cfg.kv_dtype, state_file=state_file,
                     tier=tier_settings(cfg), bf16_products=cfg.bf16_products,
                     out=lambda line: print(line, flush=True),
                     attach=_ray_service(cfg, args.json))
    except (TokenLakeError, ValueError, ConnectionError) as exc:  # no cluster to be had
        raise UsageError(f"serve: {type(exc).__name__}: {exc}") from None
    except KeyboardInterrupt:  # during start-up: the cluster has cleaned up already
        return 130


def _ray_service(cfg, json_lines: bool):
    """What ``serve --ray`` attaches to the started RayCluster: its control plane on
    ``cfg.host:cfg.control_port`` and, for the model whose weights ship with the
    project, the OpenAI-compatible API on ``cfg.host:cfg.http_port`` (the service layer
    sits above tokenlake.deploy, so the command joins the two). The model runs in this
    process while every instance is on this node; when some are on other nodes (whose
    shared buffers this process cannot map), in a compute actor per instance."""
    import ray

    from tokenlake.service.serve import SERVED_MODEL, load_served_model, pool_service

    def progress(line: str) -> None:
        print(json.dumps({"event": "progress", "message": line}) if json_lines else line,
              flush=True)

    def attach(cluster):
        model = load_served_model(progress) if cfg.model == SERVED_MODEL else None
        here = ray.get_runtime_context().get_node_id()
        if model is not None and any(cluster.node_id(i) != here for i in cluster.instances):
            progress("instances on other nodes: starting a compute actor per instance ...")
            cluster.start_compute()
        return pool_service(cluster, host=cfg.host, control_port=cfg.control_port,
                            http_port=cfg.http_port, model=model, credentials=cfg.credentials,
                            limits=cfg.http_limits())

    return attach


def products_here(cfg) -> None:
    """The ``bf16_products`` setting in this process, whose compute engine attends in
    place on a local pool (the engines take it from the cluster's config; a Ray driver
    attends nothing in place)."""
    if cfg.bf16_products:
        from tokenlake.kernels import native

        native.use_bf16_products_if_built(cfg.bf16_products)


def serve_config(cfg):
    """The :class:`~tokenlake.service.config.ServeConfig` that ``serve`` (without
    ``--ray``) serves, from the loaded settings ``cfg``
    (:class:`tokenlake.tools.config.ServeSettings`, what ``tokenlake config show``
    prints): the pool's part a :class:`~tokenlake.deploy.config.ClusterConfig` (``bind``
    is what its engines bind), the rest the service's. ``ConfigError`` for values that
    only the two together refuse (a pool too small for one segment, say)."""
    from tokenlake.deploy.config import ClusterConfig
    from tokenlake.service.config import ServeConfig

    cluster = ClusterConfig(cfg.instances, load_model(cfg.model), cfg.pool_mb << 20, cfg.segment_tokens,
                            cfg.max_rows, host=cfg.bind, insecure=cfg.insecure, kv_layout=cfg.kv_layout,
                            page_tokens=cfg.page_tokens, kv_dtype=cfg.kv_dtype, device=cfg.device,
                            bf16_products=cfg.bf16_products, **tier_settings(cfg))
    return ServeConfig(cluster, host=cfg.host, control_port=cfg.control_port, http_port=cfg.http_port,
                         engine=cfg.engine, compute=cfg.compute, credentials=cfg.credentials,
                         limits=cfg.http_limits(), orphan_grace_s=cfg.orphan_grace_s)


def _serve_local(cfg, json_lines: bool) -> int:
    """The pool on this machine (or the baseline engine, ``--engine reference``) with its
    control port and HTTP API on ``cfg.host`` (port 0: any free port), until Ctrl-C or
    SIGTERM; everything is stopped and unlinked."""
    # The local pool starts engines and maps tensors (torch): only this command loads it.
    from tokenlake.service.serve import serve_local

    check_device(cfg.device, "serve")
    products_here(cfg)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # a service manager's stop

    def emit(event: str, text: str, **data) -> None:
        print(json.dumps({"event": event, **data}) if json_lines else text, flush=True)

    def ready(served) -> None:
        info = served.info()
        where = [f"control plane at {info['address']} (tokenlake.connect; credentials in "
                 f"{info['credentials']})"] if info["address"] else []
        where += [f"OpenAI-compatible API at {info['http_url']}/v1 (metrics: "
                  f"{info['http_url']}/metrics)"] if info["http_url"] else []
        what = (f"{cfg.instances} instances of {cfg.model} ({cfg.pool_mb} MiB slab each, "
                f"C = {cfg.segment_tokens}, {cfg.kv_dtype} KV, on {cfg.device})" if cfg.engine == "pool"
                else f"{cfg.model} on the reference engine (no pool, no prefix cache; on {cfg.device})")
        if info["restored"] is not None:
            what += f", adopted from the process that served it before ({info['restored']} segments restored)"
        emit("ready", f"serving {what}; " + "; ".join(where) + "; Ctrl-C or SIGTERM stops",
             **info, instances=cfg.instances, model=cfg.model, engine=cfg.engine)

    emit("starting", f"starting ({cfg.engine}) ...", instances=cfg.instances, engine=cfg.engine)
    try:
        serve_local(serve_config(cfg), stop=stop, on_ready=ready,
                    progress=lambda line: emit("progress", line, message=line))
    except (TokenLakeError, ValueError) as exc:  # sizes, a port in use, an engine that fails
        raise UsageError(f"serve: {type(exc).__name__}: {exc}") from None
    except KeyboardInterrupt:  # during start-up: the pool has cleaned up already
        return 130
    emit("stopped", "stopped: HTTP and control servers closed, engines gone, shared memory "
                    "unlinked")
    return 0
