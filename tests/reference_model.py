"""The reference model the prefix-tree and pool state machines compare against: plain
dicts of nodes, with children, readiness and evictability recomputed on every call."""

from __future__ import annotations


class MReplica:
    def __init__(self, slot: int, ready: bool, last: float) -> None:
        self.slot, self.ready, self.last = slot, ready, last


class MNode:
    def __init__(self, parent: bytes | None, index: int) -> None:
        self.parent, self.index = parent, index
        self.replicas: dict[int, MReplica] = {}
        self.pins = self.leases = 0


class NodeModel:
    """A dict of nodes; everything else is derived from it."""

    def __init__(self) -> None:
        self.nodes: dict[bytes, MNode] = {}

    def children(self, key: bytes) -> list[bytes]:
        return [k for k, n in self.nodes.items() if n.parent == key]

    def ready(self, key: bytes) -> int:
        return sum(r.ready for r in self.nodes[key].replicas.values())

    def evictable(self, protect: bytes | None = None) -> list[tuple[bytes, int]]:
        """Ready replicas of unpinned, unleased nodes that are leaves or have a spare."""
        out = []
        for key, node in self.nodes.items():
            if node.pins or node.leases or key == protect:
                continue
            ready = self.ready(key)
            if ready > 1 or (ready == 1 and not self.children(key)):
                out += [(key, i) for i, r in node.replicas.items() if r.ready]
        return out

    def lru_order(self, victim: tuple[bytes, int]) -> tuple[float, int]:
        node = self.nodes[victim[0]]
        return node.replicas[victim[1]].last, -node.index  # older first, then deeper first

    def match(self, keys: list[bytes]) -> list[bytes]:
        out = []
        for key in keys:
            if key not in self.nodes or not self.ready(key):
                break
            out.append(key)
        return out

    def subtree(self, key: bytes) -> list[bytes]:
        out, stack = [], [key]
        while stack:
            k = stack.pop()
            out.append(k)
            stack += self.children(k)
        return out
