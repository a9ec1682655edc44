"""Whether a placement group's bundles can fit a Ray cluster, checked before asking Ray.

Ray keeps a placement group that cannot be placed pending for as long as one waits, and
says nothing about why. :func:`check_fit` compares the bundles against the cluster's
resources (in all and node by node, for the placement strategy) and raises a
``ConfigError`` naming what was asked and what the cluster has, so that an impossible
request fails at once. What it cannot see is resources that exist but are held by
others (actors, tasks, other placement groups): :func:`busy_reason` words that case once
placing has timed out.

The functions here are pure (plain numbers in, a message out); :func:`cluster_nodes`
is the one that asks Ray.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import ray

from tokenlake.core.errors import ConfigError

# Ray counts resources in units of 1e-4; comparing whole units avoids float rounding.
_UNITS = 10_000
# Nodes listed by name in a message at most (the rest are counted).
_SHOWN_NODES = 4


@dataclass(frozen=True)
class NodeResources:
    """One alive Ray node and its total resources (``{"CPU": 16.0, "GPU": 1.0, ...}``)."""

    address: str
    resources: Mapping[str, float]


def cluster_nodes() -> list[NodeResources]:
    """The alive nodes of the Ray cluster this process is connected to (``ray.nodes()``)."""
    return [NodeResources(n.get("NodeManagerAddress", "?"), dict(n.get("Resources", {})))
            for n in ray.nodes() if n.get("Alive")]


def fmt_resources(res: Mapping[str, float]) -> str:
    """``{CPU: 3, GPU: 1}``: resources as a message shows them."""
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in res.items()) + "}"


def bundles_text(n: int, bundle: Mapping[str, float]) -> str:
    """``4 bundles of {CPU: 3}``."""
    return f"{n} bundle{'s' if n != 1 else ''} of {fmt_resources(bundle)}"


def _units(x: float) -> int:
    return int(round(x * _UNITS))


def bundles_per_node(bundle: Mapping[str, float], node: Mapping[str, float]) -> int:
    """How many copies of ``bundle`` fit in ``node``'s resources at once."""
    fits = [_units(node.get(r, 0.0)) // _units(v) for r, v in bundle.items() if _units(v) > 0]
    return min(fits) if fits else 1 << 30


def check_fit(n: int, bundle: Mapping[str, float], strategy: str,
              total: Mapping[str, float], nodes: Sequence[NodeResources]) -> None:
    """Raises ``ConfigError`` when ``n`` bundles of ``bundle`` can never be placed with
    ``strategy`` on a cluster of ``nodes`` whose resources add up to ``total`` (both as
    Ray reports them: totals, not what is free now). The bundles are identical, so the
    check is exact: each node holds ``bundles_per_node`` of them; ``STRICT_SPREAD`` needs
    ``n`` nodes that hold one, ``STRICT_PACK`` one node that holds ``n``, ``PACK`` and
    ``SPREAD`` ``n`` in all."""
    what = bundles_text(n, bundle)
    for r, v in bundle.items():  # the whole cluster first: the plainest message
        if _units(n * v) > _units(total.get(r, 0.0)):
            raise ConfigError(f"{what} need {n * v:g} {r}; the Ray cluster has "
                              f"{total.get(r, 0.0):g} {r} in all ({_nodes_text(bundle, nodes)})")
    per_node = [bundles_per_node(bundle, node.resources) for node in nodes]
    if max(per_node, default=0) == 0:
        raise ConfigError(f"no node of the Ray cluster can hold one bundle of {fmt_resources(bundle)} "
                          f"({_nodes_text(bundle, nodes)})")
    if strategy == "STRICT_SPREAD" and sum(1 for k in per_node if k > 0) < n:
        raise ConfigError(
            f"STRICT_SPREAD puts each of the {what} on a node of its own, but only "
            f"{sum(1 for k in per_node if k > 0)} of the Ray cluster's {len(nodes)} nodes can hold one "
            f"({_nodes_text(bundle, nodes)})")
    if strategy == "STRICT_PACK" and max(per_node) < n:
        raise ConfigError(
            f"STRICT_PACK puts all {what} on one node, but a node holds at most {max(per_node)} "
            f"({_nodes_text(bundle, nodes)})")
    if sum(per_node) < n:
        raise ConfigError(f"{what} do not fit the Ray cluster's nodes, which hold {sum(per_node)} "
                          f"of them in all ({_nodes_text(bundle, nodes)})")


def busy_reason(n: int, bundle: Mapping[str, float], strategy: str, waited_s: float,
                free: Mapping[str, float], total: Mapping[str, float]) -> str:
    """The message for bundles that fit the cluster but were not placed within
    ``waited_s`` seconds: the resources exist and others hold them (``free`` is
    ``ray.available_resources()``)."""
    have = ", ".join(f"{free.get(r, 0.0):g} of {total.get(r, 0.0):g} {r}" for r in bundle)
    return (f"Ray could not place {bundles_text(n, bundle)} ({strategy}) within "
            f"{waited_s:g} s: the cluster has the resources, but they are busy ({have} free now; "
            "actors, tasks or other placement groups hold the rest). Free them, or wait longer "
            "(RayOptions.place_timeout_s); `ray status` shows who holds what")


def _nodes_text(bundle: Mapping[str, float], nodes: Sequence[NodeResources]) -> str:
    """``2 nodes: 10.0.0.1 has {CPU: 2}, 10.0.0.2 has {CPU: 4}``, with the bundle's
    resources only."""
    if not nodes:
        return "no alive node"
    shown = [f"{node.address} has {fmt_resources({r: node.resources.get(r, 0.0) for r in bundle})}"
             for node in nodes[:_SHOWN_NODES]]
    more = f", and {len(nodes) - _SHOWN_NODES} more" if len(nodes) > _SHOWN_NODES else ""
    return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}: " + ", ".join(shown) + more
