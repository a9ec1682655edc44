"""``tokenlake status``: what a served pool holds, asked over its control port.

Prints each instance's slots in use (of its capacity) and segment reads, the pool's
hit rate and the access-load CV across instances (docs/design.md §7), and the client
sessions open on it (docs/design.md §10: id, process, age, what each holds), from one
``stats`` call of :func:`tokenlake.connect` (which opens no session of its own).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tokenlake.core.control import ControlStats
from tokenlake.core.errors import ConfigError, EngineUnavailable
from tokenlake.core.placement import coefficient_of_variation
from tokenlake.tools.cli.args import Parser, UsageError, positive

DEFAULT_ADDRESS = "tcp://127.0.0.1:7400"


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``status`` to the command tree."""
    p: Parser = sub.add_parser(
        "status", help="instances, slots, hit rate and access CV of a served pool",
        description="Asks a pool served by 'tokenlake serve' for its statistics: per "
                    "instance the slots in use and the segment reads, then the hit rate and "
                    "the access-load CV.")
    p.add_argument("--address", default=DEFAULT_ADDRESS,
                   help="the control plane's address, as 'tokenlake serve' prints it")
    p.add_argument("--credentials", metavar="FILE",
                   help="the credentials file 'tokenlake serve' wrote (default: the one it "
                        "wrote for this port on this machine, if any)")
    p.add_argument("--timeout", type=positive(float), default=5.0, metavar="S",
                   help="seconds to wait for the pool")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run_status)


def run_status(args: argparse.Namespace) -> int:
    # tokenlake.connect loads the data plane (zmq, msgpack): only this command needs it.
    from tokenlake.service.remote import connect

    if not args.address.startswith("tcp://"):
        raise UsageError(f"status: --address must look like tcp://HOST:PORT, got {args.address!r}")
    try:
        with connect(args.address, timeout_s=args.timeout, credentials=args.credentials) as cp:
            answer = cp.status()
    except EngineUnavailable:
        raise UsageError(f"status: no pool answered at {args.address} within "
                         f"{args.timeout:g} s (is 'tokenlake serve' running there, and are "
                         "these its credentials?)") from None
    except ConfigError as exc:
        raise UsageError(f"status: {exc}") from None
    summary = status_summary(answer.stats, answer.sessions, dict(answer.restored))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_status(summary, args.address)
    return 0


def status_summary(stats: ControlStats, sessions: tuple = (),
                   restored: dict[int, int] | None = None) -> dict[str, Any]:
    """The figures ``status`` prints, as plain data (``sessions``: the server's
    :class:`~tokenlake.dataplane.messages.SessionInfo` list; ``restored``: segments
    each instance brought back when the pool was adopted, empty if it started empty)."""
    pool, restored = stats.pool, restored or {}
    return {
        "instances": [
            {"instance": i, "slots_used": pool.slots_used.get(i, 0),
             "slots_capacity": pool.slots_capacity.get(i, 0), "reads": pool.reads.get(i, 0),
             "adopted": i in restored, "restored_segments": restored.get(i, 0)}
            for i in sorted(pool.slots_capacity)
        ],
        "segments": pool.segments,
        "replicas": pool.replicas,
        "admitted_requests": stats.admitted_requests,
        "hit_tokens": stats.hit_tokens,
        "hit_rate": stats.hit_rate,
        "access_cv": coefficient_of_variation([pool.reads[i] for i in sorted(pool.reads)]),
        "evictions": pool.evictions,
        "replications": pool.replications,
        "tier": None if pool.tier is None else {
            "capacity": pool.tier.capacity, "held": {str(i): n for i, n in pool.tier.held.items()},
            "written": pool.tier.written, "demotions": pool.tier.demotions,
            "promotions": pool.tier.promotions, "failed_promotions": pool.tier.failed_promotions,
            "dropped": pool.tier.dropped,
            "engines": {str(i): c for i, c in sorted(pool.tier.engines.items())}},
        "sessions": [
            {"session": x.session, "pid": x.pid, "label": x.label, "age_s": round(x.age_s, 1),
             "idle_s": round(x.idle_s, 1), "iterations": x.iterations, "requests": x.requests,
             "instances": list(x.instances)}
            for x in sessions
        ],
    }


def print_status(s: dict[str, Any], address: str) -> None:
    print(f"pool at {address}: {len(s['instances'])} instances, {s['segments']} segments "
          f"({s['replicas']} replicas)")
    print("instance  slots used  segment reads  adopted")
    for row in s["instances"]:
        used = f"{row['slots_used']}/{row['slots_capacity']}"
        adopted = f"yes, {row['restored_segments']} segments back" if row["adopted"] else "no"
        print(f"{row['instance']:>8}  {used:>10}  {row['reads']:>13}  {adopted}")
    print(f"hit rate {s['hit_rate']:.1%} ({s['hit_tokens']} tokens, {s['admitted_requests']} "
          f"requests)   access CV {s['access_cv']:.1%}   evictions {s['evictions']}   "
          f"replications {s['replications']}")
    tier = s.get("tier")
    if tier is None:
        print("tier: none (segments evicted from the slabs are dropped)")
    else:
        held = ", ".join(f"{i}: {n}" for i, n in sorted(tier["held"].items(), key=lambda x: int(x[0])))
        print(f"tier: {tier['capacity']} segments per instance, held {{{held}}}   written "
              f"{tier['written']}   demoted {tier['demotions']}   promoted {tier['promotions']} "
              f"(failed {tier['failed_promotions']})   dropped {tier['dropped']}")
        for i, c in tier.get("engines", {}).items():
            print(f"  instance {i}: wrote {c.get('written', 0):.0f} (errors {c.get('write_errors', 0):.0f}, "
                  f"refused {c.get('refused', 0):.0f})   read {c.get('reads', 0):.0f} (failed "
                  f"{c.get('read_failures', 0):.0f})   staged {c.get('staged_bytes', 0) / (1 << 20):.1f} MiB   "
                  f"waited {c.get('paced_s', 0):.1f} s on the write bandwidth")
    print(f"{len(s['sessions'])} client sessions (besides the serving process's own)")
    if s["sessions"]:
        print("session      pid     age    idle  iterations  requests  instances  label")
        for x in s["sessions"]:
            print(f"{x['session']:>7}  {x['pid']:>7}  {x['age_s']:>5.0f}s  {x['idle_s']:>5.1f}s  "
                  f"{x['iterations']:>10}  {x['requests']:>8}  {','.join(map(str, x['instances'])) or '-':>9}"
                  f"  {x['label']}")
