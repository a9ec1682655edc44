"""The ``tokenlake`` command: one argument tree for every tool.

``tokenlake demo``               SmolLM2-135M through a 4-instance pool, checked against a plain engine
``tokenlake walkthrough``        control-plane walk-through (LooGLE-like workload, 8 instances)
``tokenlake serve``              a local pool (or one on Ray: --ray ADDR) served until Ctrl-C
``tokenlake config show``        the effective settings of ``serve`` and where each came from
``tokenlake status``             instances, slots, hit rate and access CV of a served pool
``tokenlake bench WHAT``         benchmarks: plans, query-vs-fetch, e2e, scheduler, sim
``tokenlake threshold``          the paper's segment-size threshold for a model and hardware
``tokenlake fit-roofline``       fit the scheduler's latency model to roofline samples
``tokenlake profile-cpu``        measure this machine's hardware profile
``tokenlake profile-latency``    measure the CPU compute engine and fit its latency model
``tokenlake eval EXPERIMENT``    the paper's §7 experiments on the simulator (docs/evaluation.md)
``tokenlake sim --trace FILE``   replay a trace on one simulated system (docs/simulator.md)

Exit codes: 0 success; 2 a mistake in the command line or its input (one line on stderr,
``tokenlake: error: ...``, no traceback); 1 a run whose result is wrong (``demo``: an answer
differs from the reference engine; ``eval validate``: the simulator disagrees with the
engines; ``sim``: the simulation could not finish); 130 interrupted (Ctrl-C); 143 stopped by
SIGTERM (``serve``: 0, a clean stop). Either unwinds the command as an exception does: the
pools, servers and vLLM processes it started are stopped and their shared memory and
temporary files removed. Any other failure is a bug and shows its traceback.

Building the tree imports no torch, numpy, zmq, Ray or :mod:`evals`: each command
imports what it needs when it runs, so ``tokenlake --help`` stays fast.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence

import tokenlake
from tokenlake.core.errors import ConfigError
from tokenlake.engines.openmp import OPENMP_ENV
from tokenlake.tools.cli import bench as cli_bench
from tokenlake.tools.cli import config as cli_config
from tokenlake.tools.cli import eval as cli_eval
from tokenlake.tools.cli import model as cli_model
from tokenlake.tools.cli import pool as cli_pool
from tokenlake.tools.cli import status as cli_status
from tokenlake.tools.cli.args import PROG, Parser, UsageError, report
from tokenlake.tools.interrupt import Terminated, sigterm_raises


def build_parser() -> Parser:
    """The whole command tree; each leaf sets ``run``, a function of the parsed arguments
    returning the exit code."""
    parser = Parser(prog=PROG, description="TokenLake: a cluster-wide KV-cache pool for LLM "
                                           "serving. 'tokenlake COMMAND --help' for each command.")
    parser.add_argument("--version", action="version", version=f"{PROG} {tokenlake.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cli_pool.register(sub)
    cli_bench.register(sub)
    cli_model.register(sub)
    cli_eval.register(sub)
    cli_config.register(sub)
    cli_status.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``tokenlake ARGV``; returns the exit code (parse errors raise ``SystemExit(2)``)."""
    # Idle OpenMP workers of torch spin by default and take the CPU from the engine
    # processes on small machines (measured: zmq sends 7x slower in the compute engine).
    # Passive workers sleep at once, though, and a decode step's ~200 back-to-back kernel
    # calls then pay a wake-up each (~50 us): GNU OpenMP's workers spin 2,000 rounds
    # (tens of microseconds) before they sleep, bridging those gaps but not a wait for
    # the pool (measured with `tokenlake bench e2e`: 1.1-1.3x the decode tokens/s).
    # Must be set before torch is imported; an explicit setting wins.
    for name, value in OPENMP_ENV.items():
        os.environ.setdefault(name, value)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command_line = f"{PROG} {shlex.join(argv)}"  # recorded in the files a command writes
    restore = sigterm_raises()  # (a command may set its own)
    try:
        return args.run(args)
    except (UsageError, ConfigError) as exc:  # ConfigError: a value from the command line
        return report(str(exc))
    except Terminated:
        return 143
    except KeyboardInterrupt:
        return 130
    finally:
        if restore is not None:
            restore()

