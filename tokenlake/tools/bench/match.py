"""Prefix matching and insertion of :class:`~tokenlake.core.prefix_tree.PrefixTree` beside a
page-size-1 radix tree (``tokenlake bench plans``, issue #19).

:class:`RadixStandIn` is a radix tree written here to SGLang's ``RadixCache`` algorithm
with page size 1: every node holds a run of token ids, children are found by their
first token, a match compares a node's run with the prompt token by token and stops
inside it, an insert splits a node where a prompt leaves it. It keeps one value (a slot
index) per token, as a radix KV cache does. Nothing here asserts a speed: the figures
are printed, medians of repeated runs, both trees timed alternately in one process.

Workloads (arrays of token ids, as the issue states them): a 128K-token document with
branches off it, 64 prompts of 8K sharing their first 2K, 200 unrelated 4K prompts; and
inserting 10,000 prompts of 4K tokens.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
import tracemalloc
from array import array
from collections.abc import Callable

from tokenlake.core.prefix_tree import PrefixTree
from tokenlake.core.segments import SegmentHasher


class _RNode:
    __slots__ = ("children", "parent", "key", "value", "last_access")

    def __init__(self, key: list[int], value: array, parent: _RNode | None) -> None:
        self.children: dict[int, _RNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.last_access = 0.0


def _match_len(a: list[int], b: list[int]) -> int:
    """Leading tokens ``a`` and ``b`` share, compared one by one (page size 1)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class RadixStandIn:
    """A radix tree over token ids with page size 1, to SGLang's algorithm."""

    def __init__(self) -> None:
        self.root = _RNode([], array("q"), None)
        self._next = 0

    def match_prefix(self, tokens: list[int]) -> array:
        """The values (slot indices) of the longest cached prefix of ``tokens``."""
        node, out, key = self.root, array("q"), tokens
        now = time.monotonic()
        while key:
            child = node.children.get(key[0])
            if child is None:
                break
            child.last_access = now
            n = _match_len(child.key, key)
            if n < len(child.key):
                out.extend(child.value[:n])
                break
            out.extend(child.value)
            node, key = child, key[n:]
        return out

    def insert(self, tokens: list[int]) -> int:
        """Caches ``tokens`` (new values for the part not cached); returns the tokens
        that were cached already."""
        node, key, done = self.root, tokens, 0
        while key:
            child = node.children.get(key[0])
            if child is None:
                value = array("q", range(self._next, self._next + len(key)))
                self._next += len(key)
                node.children[key[0]] = _RNode(list(key), value, node)
                return done
            n = _match_len(child.key, key)
            if n < len(child.key):  # split the child where the prompt leaves it
                upper = _RNode(child.key[:n], child.value[:n], node)
                child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
                upper.children[child.key[0]] = child
                node.children[upper.key[0]] = upper
                child = upper
            done += n
            node, key = child, key[n:]
        return done


def _tree_insert(tree: PrefixTree, hasher: SegmentHasher, prompt: array, slots: list[int]) -> int:
    """What the control plane records for a new prompt, as ``gen_plans`` and ``complete``
    do it: a node per whole segment (its chained key and tokens) with a pending replica,
    then every replica marked stored; returns the segments added."""
    c = hasher.segment_tokens
    raw = prompt.tobytes()
    step = 4 * c
    parent, added = None, []
    for i, key in enumerate(hasher.iter_keys(raw)):
        if tree.insert(key, parent, i, raw[i * step : (i + 1) * step]):
            tree.add_replica(key, i % 8, slots[0], 0.0)
            slots[0] += 1
            added.append((key, i % 8))
        parent = key
    for key, inst in added:
        tree.set_ready(key, inst, 0.0)
    return len(added)


def _workloads(seed: int):
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 32000) for _ in range(n)]

    doc = toks(128 * 1024)
    branches = [doc[:cut] + toks(4096) for cut in range(8192, 128 * 1024, 16384)]
    shared = toks(2048)
    eight_k = [shared + toks(6144) for _ in range(64)]
    unrelated = [toks(4096) for _ in range(200)]
    return doc, branches, eight_k, unrelated


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def bench_match_vs_radix(segment_tokens=(64, 512), repeats: int = 5, inserts: int = 10_000,
                         seed: int = 0) -> dict:
    """Match and insert times of ``PrefixTree`` at each ``C`` (page hits on) and of the
    radix stand-in on the same prompts, with their ratios, and the memory per cached
    token of each structure (tracemalloc, after building the same contents)."""
    import numpy  # noqa: F401  (the tree narrows tokens with it: loaded before memory is measured)

    doc, branches, eight_k, unrelated = _workloads(seed)
    contents = [doc, *branches, *eight_k, *unrelated]
    arrays = {id(p): array("i", p) for p in contents}
    cached_tokens = sum(map(len, contents))
    out: dict = {"cached_tokens": cached_tokens, "radix": {}, "tokenlake": {}, "ratio": {}}

    radix = RadixStandIn()
    radix_bytes = _allocated(lambda: [radix.insert(p) for p in contents])
    out["radix"]["bytes_per_cached_token"] = radix_bytes / cached_tokens

    for c in segment_tokens:
        hasher = SegmentHasher(c, f"bench-match/C{c}")
        tree = PrefixTree(hasher, page_tokens=16 if c % 16 == 0 else c)
        slots = [0]
        tree_bytes = _allocated(lambda t=tree, h=hasher, s=slots: [
            _tree_insert(t, h, arrays[id(p)], s) for p in contents])
        mine = {"bytes_per_cached_token": tree_bytes / cached_tokens}
        theirs = out["radix"]
        cases = {"match_128k": (doc, 1), "match_8k": (eight_k[17], 1),
                 "match_4k_unrelated": (unrelated[42], 1)}
        for name, (prompt, _) in cases.items():
            arr = arrays[id(prompt)]
            # Alternately, so that drift on a shared machine hits both alike.
            t_radix, t_mine = [], []
            for _ in range(repeats):
                t_radix.append(_median_ms(lambda p=prompt: radix.match_prefix(p), 3))
                t_mine.append(_median_ms(lambda a=arr, t=tree: t.match(a), 3))
            assert tree.match(arr).hit_tokens >= len(prompt) // c * c
            theirs[name + "_ms"] = statistics.median(t_radix)
            mine[name + "_ms"] = statistics.median(t_mine)
            out["ratio"][f"{name}_C{c}"] = theirs[name + "_ms"] / mine[name + "_ms"]
        out["tokenlake"][f"C{c}"] = mine
        out["ratio"][f"memory_C{c}"] = mine["bytes_per_cached_token"] / theirs["bytes_per_cached_token"]

    out["inserts"] = _insert_times(out, segment_tokens, inserts, seed)
    return out


def _allocated(build: Callable[[], object]) -> int:
    """Bytes that ``build()`` leaves allocated (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    kept = build()
    size = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del kept
    return size


def _insert_times(out: dict, segment_tokens, inserts: int, seed: int) -> int:
    """Inserting ``inserts`` unrelated 4K prompts into empty structures, in rounds of
    200, alternately; fills ``out`` and returns the prompts inserted per structure."""
    rng = random.Random(seed + 1)
    fresh = [array("i", (rng.randrange(3, 32000) for _ in range(4096))) for _ in range(200)]
    as_lists = [p.tolist() for p in fresh]
    rounds = max(1, inserts // len(fresh))
    for c in segment_tokens:
        hasher = SegmentHasher(c, f"bench-insert/C{c}")
        t_radix, t_mine = [], []
        for _ in range(rounds):
            radix = RadixStandIn()
            t0 = time.perf_counter()
            for p in as_lists:
                radix.insert(p)
            t_radix.append(time.perf_counter() - t0)
            tree = PrefixTree(hasher, page_tokens=16 if c % 16 == 0 else c)
            slots = [0]
            t0 = time.perf_counter()
            for p in fresh:
                _tree_insert(tree, hasher, p, slots)
            t_mine.append(time.perf_counter() - t0)
        per_radix = statistics.median(t_radix) / len(fresh) * 1e3
        per_mine = statistics.median(t_mine) / len(fresh) * 1e3
        out["radix"]["insert_4k_ms"] = per_radix
        out["tokenlake"][f"C{c}"]["insert_4k_ms"] = per_mine
        out["ratio"][f"insert_4k_C{c}"] = per_radix / per_mine
    return rounds * len(fresh)
