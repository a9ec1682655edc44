"""An approximate multi-tenant radix tree over token ids, as sgl-router keeps one.

Each node holds an edge of token ids and, per tenant (worker), the last time that tenant
used the prefix ending at this node. A tenant present at a node is present at all its
ancestors (inserts mark the whole path; eviction removes leaves only), so the tenants of
the deepest matched node are the tenants with the longest match. Pure: the caller passes
the time.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_used: dict[Hashable, float] = field(default_factory=dict)


class RadixTree:
    def __init__(self) -> None:
        self.root = _Node((), None)
        self.sizes: dict[Hashable, int] = {}  # tokens held per tenant

    def add_tenant(self, tenant: Hashable, now: float = 0.0) -> None:
        self.sizes.setdefault(tenant, 0)
        self.root.last_used.setdefault(tenant, now)

    def _touch(self, node: _Node, tenant: Hashable, now: float) -> None:
        if tenant not in node.last_used:
            self.sizes[tenant] = self.sizes.get(tenant, 0) + len(node.key)
        node.last_used[tenant] = now

    def insert(self, tokens: Sequence[int], tenant: Hashable, now: float) -> None:
        tokens = tuple(tokens)
        node, i = self.root, 0
        self._touch(node, tenant, now)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                new = _Node(tokens[i:], node)
                node.children[tokens[i]] = new
                self._touch(new, tenant, now)
                return
            n = _common(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child, tenant, now)
            node, i = child, i + n

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut ``child``'s edge after ``n`` tokens; return the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.key[:n], parent, last_used=dict(child.last_used))
        parent.children[child.key[0]] = upper
        child.key = child.key[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def match(
        self, tokens: Sequence[int], tenant: Hashable | None = None
    ) -> tuple[int, dict[Hashable, float]]:
        """Longest matched prefix length and {tenant: last use} at its deepest node.

        With ``tenant`` given, only nodes that tenant holds are walked (its local match).
        """
        tokens = tuple(tokens)
        node, i = self.root, 0
        tenants = dict(node.last_used)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None or (tenant is not None and tenant not in child.last_used):
                break
            n = _common(child.key, tokens, i)
            i += n
            tenants = dict(child.last_used)
            if n < len(child.key):
                break
            node = child
        if tenant is not None:
            tenants = {tenant: tenants[tenant]} if tenant in tenants else {}
        return i, tenants

    def evict_tenant(self, tenant: Hashable, max_tokens: int) -> list[tuple[int, ...]]:
        """Drop ``tenant``'s least recently used leaves until it holds <= max_tokens.

        Returns the full token paths evicted, in eviction order.
        """
        heap: list[tuple[float, int, _Node]] = []
        seq = 0
        for node in self._nodes():
            if node is not self.root and tenant in node.last_used and _is_leaf(node, tenant):
                heap.append((node.last_used[tenant], seq, node))
                seq += 1
        heapq.heapify(heap)
        evicted: list[tuple[int, ...]] = []
        while self.sizes.get(tenant, 0) > max_tokens and heap:
            _, _, node = heapq.heappop(heap)
            evicted.append(_path(node))
            del node.last_used[tenant]
            self.sizes[tenant] -= len(node.key)
            parent = node.parent
            assert parent is not None
            if not node.last_used and not node.children:
                del parent.children[node.key[0]]
            if parent is not self.root and _is_leaf(parent, tenant):
                heapq.heappush(heap, (parent.last_used[tenant], seq, parent))
                seq += 1
        return evicted

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def tenant_prefixes(self, tenant: Hashable) -> set[tuple[int, ...]]:
        """Every full token path whose leaf (for ``tenant``) the tenant holds."""
        return {
            _path(n)
            for n in self._nodes()
            if n is not self.root and tenant in n.last_used and _is_leaf(n, tenant)
        }


def _common(key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    n = 0
    limit = min(len(key), len(tokens) - start)
    while n < limit and key[n] == tokens[start + n]:
        n += 1
    return n


def _is_leaf(node: _Node, tenant: Hashable) -> bool:
    return not any(tenant in c.last_used for c in node.children.values())


def _path(node: _Node) -> tuple[int, ...]:
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(t for key in reversed(parts) for t in key)
