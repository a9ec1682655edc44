"""Property tests of segment keys, the global prefix tree, the hash ring and heavy hitters.

* :class:`TreeMachine` drives :class:`tokenlake.core.prefix_tree.PrefixTree` directly with
  random inserts, replicas, commits, touches, pins, leases, evictions and subtree removals,
  unsalted and under cache salts (each salt's sequences under their own root), and
  compares it after every step with a reference model made of plain dicts (docs/design.md §4:
  whole-segment matches of ready segments only, under one salt, leaf-only eviction,
  global LRU).
* Segment keys are compared with an independent blake2b implementation and across two
  interpreters with different ``PYTHONHASHSEED``.
* :class:`tokenlake.core.placement.HashRing` moves about 1/N of the homes when an instance
  comes or goes, and spreads them.
* :func:`tokenlake.core.placement.find_heavy_hitters` equals a brute-force top-k by count.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from reference_model import MNode, MReplica, NodeModel

from tokenlake.core.errors import ConfigError, SegmentNotFound
from tokenlake.core.placement import HashRing, find_heavy_hitters
from tokenlake.core.prefix_tree import PrefixTree
from tokenlake.core.segments import KEY_BYTES, SegmentHasher, token_bytes

REPO = Path(__file__).resolve().parents[1]
C = 2  # tokens per segment in the state machines: short sequences, many shared prefixes
TOKENS = st.lists(st.integers(0, 2), max_size=4 * C + 1)
INSTANCES = (0, 1, 2)
SALTS = st.sampled_from([None, None, "", "a", "b"])  # "": no salt, as None


# ------------------------------------------------------------------ segment keys


def reference_keys(tokens: list[int], c: int, namespace: str) -> list[bytes]:
    """docs/design.md §4 written out again: h_-1 = blake2b(ns), h_i = blake2b(h_{i-1} || le-int32)."""
    h = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    out = []
    for i in range(len(tokens) // c):
        seg = tokens[i * c : (i + 1) * c]
        h = hashlib.blake2b(h + struct.pack(f"<{c}i", *seg), digest_size=16).digest()
        out.append(h)
    return out


FIXED_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, -1, 2**31 - 1, 0, 7]
KEY_SCRIPT = (
    "import json, sys\n"
    "from tokenlake.core.segments import SegmentHasher\n"
    "h = SegmentHasher(4, sys.argv[1])\n"
    "print(json.dumps([k.hex() for k in h.keys(json.loads(sys.argv[2]))]))\n"
)


def keys_in_subprocess(hashseed: str, namespace: str, tokens: list[int]) -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=hashseed)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", KEY_SCRIPT, namespace, json.dumps(tokens)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def test_keys_are_stable_across_processes():
    a = keys_in_subprocess("0", "llama-7b/fp16", FIXED_TOKENS)
    b = keys_in_subprocess("4242", "llama-7b/fp16", FIXED_TOKENS)
    here = [k.hex() for k in SegmentHasher(4, "llama-7b/fp16").keys(FIXED_TOKENS)]
    assert a == b == here
    assert here == [k.hex() for k in reference_keys(FIXED_TOKENS, 4, "llama-7b/fp16")]
    assert len(here) == 4 and all(len(bytes.fromhex(k)) == KEY_BYTES for k in here)
    # Another namespace (model or KV layout) never shares a key.
    other = keys_in_subprocess("7", "llama-7b/fp8", FIXED_TOKENS)
    assert not set(other) & set(here)


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=24),
    c=st.integers(1, 5),
    data=st.data(),
)
def test_keys_chain_over_all_earlier_tokens(tokens, c, data):
    hasher = SegmentHasher(c, "ns")
    keys = hasher.keys(tokens)
    assert keys == reference_keys(tokens, c, "ns")
    assert hasher.keys(token_bytes(tokens)) == keys  # raw int32 bytes hash the same
    assert keys == list(hasher.iter_keys(tokens))
    # Continuing a chain from a key equals hashing the whole sequence.
    cut = data.draw(st.integers(0, len(tokens) // c)) * c
    head = keys[: cut // c]
    assert head + hasher.keys(tokens[cut:], parent=head[-1] if head else None) == keys
    # One changed token changes its segment's key and every later key, nothing earlier.
    pos = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[pos] = changed[pos] + 1 if changed[pos] < 2**31 - 1 else 0
    keys2 = hasher.keys(changed)
    seg = pos // c
    assert keys2[:seg] == keys[:seg]
    assert all(a != b for a, b in zip(keys2[seg:], keys[seg:]))
    # Keys of another namespace are all different.
    assert not set(SegmentHasher(c, "ns2").keys(tokens)) & set(keys)


def test_token_bytes_rejects_out_of_range_and_ragged_input():
    with pytest.raises(ValueError):
        token_bytes([2**31])
    with pytest.raises(ValueError):
        token_bytes(b"\x00\x01\x02")
    with pytest.raises(ConfigError):
        SegmentHasher(0, "ns")
    with pytest.raises(ConfigError):
        SegmentHasher(4, "")


# ---------------------------------------------------------- prefix tree vs model


class TreeModel(NodeModel):
    """The reference for the tree alone (see tests/reference_model.py)."""


def check_tree_against_model(tree: PrefixTree, model: TreeModel) -> None:
    """Exact comparison of the tree with the model, LRU victim included."""
    tree.check()  # no orphans, children links, LRU index exact, every node under a root
    assert set(tree.keys()) == set(model.nodes)
    assert set(tree.children(None)) == {k for k, n in model.nodes.items() if n.parent is None}
    firsts = {k for k, n in model.nodes.items() if n.index == 0}
    salted = {model.nodes[k].parent for k in firsts} - {None}  # a salt's root while in use
    assert tree.roots()[0] is None and set(tree.roots()[1:]) == salted
    assert set(tree.first_segments()) == firsts
    for root in salted:
        assert set(tree.children(root)) == set(model.children(root))
    for key, node in model.nodes.items():
        assert tree.parent(key) == node.parent
        # never an orphaned suffix; a first segment's parent is a root (None or a salt's)
        assert node.parent in model.nodes if node.index else node.parent not in model.nodes
        assert tree.index(key) == node.index
        assert set(tree.children(key)) == set(model.children(key))
        allreps = {loc.instance: loc.slot for loc in tree.replicas(key, ready_only=False)}
        assert allreps == {i: r.slot for i, r in node.replicas.items()}
        ready = {loc.instance for loc in tree.replicas(key)}
        assert ready == {i for i, r in node.replicas.items() if r.ready}
        assert tree.is_ready(key) == bool(ready)
        assert tree.is_pinned(key) == (node.pins > 0)
        assert tree.lease_count(key) == node.leases
    evictable = model.evictable()
    assert tree.evictable_count() == len(evictable)
    victim = tree.lru_victim()
    if not evictable:
        assert victim is None
    else:
        assert victim in evictable
        assert model.lru_order(victim) == min(model.lru_order(v) for v in evictable)


class TreeMachine(RuleBasedStateMachine):
    """Random operations on a PrefixTree, mirrored on :class:`TreeModel`."""

    @initialize()
    def setup(self):
        self.hasher = SegmentHasher(C, "tree-props")
        self.tree = PrefixTree(self.hasher)
        self.model = TreeModel()
        self.now = 0.0
        self.slots = itertools.count()  # the tree does not own slots: any distinct number
        self.pinned: list[tuple[bytes, ...]] = []
        self.leased: list[tuple[bytes, ...]] = []

    # ------------------------------------------------------------- helpers
    def _pick(self, data, pred=lambda key: True):
        keys = sorted(k for k in self.model.nodes if pred(k))
        return data.draw(st.sampled_from(keys)) if keys else None

    def _forget(self, keys) -> None:
        gone = set(keys)
        self.pinned = [t for t in (tuple(k for k in t if k not in gone) for t in self.pinned) if t]
        self.leased = [t for t in (tuple(k for k in t if k not in gone) for t in self.leased) if t]

    # --------------------------------------------------------------- rules
    @rule(dt=st.sampled_from([0.0, 0.0, 0.5, 1.0, 7.0]))
    def advance(self, dt):
        self.now += dt

    @rule(tokens=TOKENS, salt=SALTS, data=st.data())
    def insert_chain(self, tokens, salt, data):
        """Inserts every full segment (dedup) under ``salt``'s root and gives new ones a
        replica, maybe ready."""
        parent = self.tree.root_key(salt)
        for i, key in enumerate(self.hasher.keys(tokens, parent=parent)):
            fresh = key not in self.model.nodes
            assert self.tree.insert(key, parent, i) is fresh
            if fresh:
                self.model.nodes[key] = MNode(parent, i)
                inst = data.draw(st.sampled_from(INSTANCES))
                ready = data.draw(st.booleans())
                slot = next(self.slots)
                self.tree.add_replica(key, inst, slot, self.now, ready=ready)
                self.model.nodes[key].replicas[inst] = MReplica(slot, ready, self.now)
            parent = key

    @rule(data=st.data())
    def bad_inserts(self, data):
        key = self._pick(data)
        stranger = b"\x00" * KEY_BYTES
        with pytest.raises(SegmentNotFound):
            self.tree.insert(b"\x01" * KEY_BYTES, stranger, 1)
        with pytest.raises(ValueError):
            self.tree.insert(b"\x02" * KEY_BYTES, None, 3)
        with pytest.raises(ValueError):  # the unsalted root is None, not its key
            self.tree.insert(b"\x02" * KEY_BYTES, self.hasher.root, 0)
        if key is not None:
            with pytest.raises(ValueError):
                self.tree.insert(b"\x03" * KEY_BYTES, key, self.model.nodes[key].index + 2)
            with pytest.raises(ValueError):  # a first segment follows a root
                self.tree.insert(b"\x03" * KEY_BYTES, key, 0)

    @rule(data=st.data())
    def add_replica(self, data):
        key = self._pick(data, lambda k: len(self.model.nodes[k].replicas) < len(INSTANCES))
        if key is None:
            return
        node = self.model.nodes[key]
        inst = data.draw(st.sampled_from([i for i in INSTANCES if i not in node.replicas]))
        ready = data.draw(st.booleans())
        slot = next(self.slots)
        self.tree.add_replica(key, inst, slot, self.now, ready=ready)
        node.replicas[inst] = MReplica(slot, ready, self.now)
        with pytest.raises(ValueError):
            self.tree.add_replica(key, inst, next(self.slots), self.now)

    @rule(data=st.data())
    def set_ready(self, data):
        key = self._pick(data, lambda k: bool(self.model.nodes[k].replicas))
        if key is None:
            return
        node = self.model.nodes[key]
        inst = data.draw(st.sampled_from(sorted(node.replicas)))
        self.tree.set_ready(key, inst, self.now)
        node.replicas[inst].ready, node.replicas[inst].last = True, self.now

    @rule(data=st.data())
    def touch(self, data):
        key = self._pick(data, lambda k: bool(self.model.nodes[k].replicas))
        if key is None:
            return
        node = self.model.nodes[key]
        inst = data.draw(st.sampled_from(sorted(node.replicas)))
        when = self.now - data.draw(st.sampled_from([0.0, 0.0, 2.0]))  # stale touches too
        self.tree.touch(key, inst, when)
        node.replicas[inst].last = max(node.replicas[inst].last, when)

    @rule(data=st.data())
    def remove_replica(self, data):
        key = self._pick(data, lambda k: bool(self.model.nodes[k].replicas))
        if key is None:
            return
        node = self.model.nodes[key]
        inst = data.draw(st.sampled_from(sorted(node.replicas)))
        last = len(node.replicas) == 1
        if last and (self.model.children(key) or node.pins or node.leases):
            with pytest.raises(ValueError):
                self.tree.remove_replica(key, inst)
            return
        assert self.tree.remove_replica(key, inst) == node.replicas.pop(inst).slot
        if last:
            del self.model.nodes[key]
            self._forget([key])

    @rule()
    def evict(self):
        """What the pool does: remove the LRU victim; a pinned or leased node never goes."""
        victim = self.tree.lru_victim()
        if victim is None:
            assert not self.model.evictable()
            return
        key, inst = victim
        node = self.model.nodes[key]
        assert not node.pins and not node.leases and node.replicas[inst].ready
        self.tree.remove_replica(key, inst)
        del node.replicas[inst]
        if not node.replicas:
            assert not self.model.children(key)
            del self.model.nodes[key]

    @precondition(lambda self: self.model.nodes)
    @rule(data=st.data())
    def remove_subtree(self, data):
        key = data.draw(st.sampled_from(sorted(self.model.nodes)))
        sub = self.model.subtree(key)
        expect = sorted(
            (k, i, r.slot) for k in sub for i, r in self.model.nodes[k].replicas.items()
        )
        assert sorted(self.tree.remove_subtree(key)) == expect
        for k in sub:
            del self.model.nodes[k]
        self._forget(sub)

    @rule(tokens=TOKENS, lease=st.booleans(), salt=SALTS)
    def pin_or_lease_match(self, tokens, lease, salt):
        m = self.tree.match(tokens, salt=salt)
        if not m.keys:
            return
        (self.tree.lease if lease else self.tree.pin)(m.keys)
        for k in m.keys:
            if lease:
                self.model.nodes[k].leases += 1
            else:
                self.model.nodes[k].pins += 1
        (self.leased if lease else self.pinned).append(m.keys)

    @rule(data=st.data(), lease=st.booleans())
    def release(self, data, lease):
        held = self.leased if lease else self.pinned
        if not held:
            key = self._pick(data, lambda k: not self.model.nodes[k].pins)
            if key is not None:
                with pytest.raises(ValueError):  # nothing to release: nothing changes
                    self.tree.unpin([key])
            return
        keys = held.pop(data.draw(st.integers(0, len(held) - 1)))
        (self.tree.unlease if lease else self.tree.unpin)(keys)
        for k in keys:
            if lease:
                self.model.nodes[k].leases -= 1
            else:
                self.model.nodes[k].pins -= 1

    @rule(tokens=TOKENS, cap=st.none() | st.integers(0, 4 * C + 1), raw=st.booleans(),
          salt=SALTS)
    def match(self, tokens, cap, raw, salt):
        m = self.tree.match(token_bytes(tokens) if raw else tokens, max_tokens=cap, salt=salt)
        limit = len(tokens) if cap is None else min(cap, len(tokens))
        want = self.model.match(self.hasher.keys(tokens[: limit // C * C],
                                                 parent=self.tree.root_key(salt)))
        assert list(m.keys) == want
        assert m.hit_tokens == len(want) * C == m.num_segments * C
        for key, locs in zip(m.keys, m.replicas):
            node = self.model.nodes[key]
            assert {(x.instance, x.slot) for x in locs} == {
                (i, r.slot) for i, r in node.replicas.items() if r.ready
            }

    @invariant()
    def agrees_with_model(self):
        if hasattr(self, "model"):
            check_tree_against_model(self.tree, self.model)


TestPrefixTreeMachine = TreeMachine.TestCase
TestPrefixTreeMachine.settings = settings(max_examples=100, stateful_step_count=80, deadline=None)


# ------------------------------------------------------------------- hash ring


def _random_keys(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(KEY_BYTES) for _ in range(n)]


def test_ring_adding_an_instance_moves_about_one_nth_only_to_it():
    keys = _random_keys(20_000, 1)
    ring = HashRing(range(8))
    before = [ring.home(k) for k in keys]
    counts = Counter(before)
    assert set(counts) == set(range(8))
    assert all(0.05 <= counts[i] / len(keys) <= 0.25 for i in range(8)), counts
    ring.add(8)
    after = [ring.home(k) for k in keys]
    moved = [(a, b) for a, b in zip(before, after) if a != b]
    assert 0.05 <= len(moved) / len(keys) <= 0.20  # ideal 1/9 = 11%
    assert all(b == 8 for _, b in moved)
    # Same ring built in another order and another object: same homes (stable hashing).
    assert [HashRing([8, *range(8)]).home(k) for k in keys[:500]] == after[:500]


@pytest.mark.parametrize("gone", [0, 3, 7])
def test_ring_removing_an_instance_moves_only_its_keys(gone):
    keys = _random_keys(20_000, 2)
    ring = HashRing(range(8))
    before = [ring.home(k) for k in keys]
    ring.remove(gone)
    after = [ring.home(k) for k in keys]
    assert gone not in after
    assert all(a == b for a, b in zip(before, after) if a != gone)
    assert all(a == gone for a, b in zip(before, after) if a != b)


def test_ring_preference_starts_at_home_and_lists_every_instance_once():
    ring = HashRing([3, 5, 9, 11], vnodes=16)
    for key in _random_keys(300, 3):
        pref = list(ring.preference(key))
        assert pref[0] == ring.home(key)
        assert sorted(pref) == [3, 5, 9, 11]
    with pytest.raises(ConfigError):
        ring.add(5)
    with pytest.raises(ConfigError):
        ring.remove(4)
    with pytest.raises(ConfigError):
        HashRing().home(b"\x00" * KEY_BYTES)
    assert list(HashRing().preference(b"\x00" * KEY_BYTES)) == []


# -------------------------------------------------------------- heavy hitters


@st.composite
def monotone_trees(draw):
    """(parents, counts): node i's parent is < i (or -1); a child's count <= its parent's."""
    n = draw(st.integers(0, 40))
    parents, counts = [], []
    for i in range(n):
        p = draw(st.integers(-1, i - 1))
        top = 30 if p < 0 else counts[p]
        parents.append(p)
        counts.append(draw(st.integers(0, top)))
    return parents, counts


@settings(max_examples=200, deadline=None)
@given(tree=monotone_trees(), budget=st.integers(0, 45), shuffle=st.randoms(use_true_random=False))
def test_heavy_hitters_equal_brute_force_top_k(tree, budget, shuffle):
    parents, counts = tree
    keys = [bytes([i]) * KEY_BYTES for i in range(len(parents))]
    order = list(range(len(keys)))
    shuffle.shuffle(order)  # key order must not matter
    kids: dict[bytes, list[bytes]] = {k: [] for k in keys}
    roots = []
    for i in order:
        (roots if parents[i] < 0 else kids[keys[parents[i]]]).append(keys[i])
    accesses = {k: c for k, c in zip(keys, counts) if c or shuffle.random() < 0.5}
    out = find_heavy_hitters(roots, lambda k: kids[k], accesses, budget)
    count_of = dict(zip(keys, counts))
    brute = sorted((c for c in counts if c > 0), reverse=True)[:budget]
    assert sorted((count_of[k] for k in out), reverse=True) == brute
    assert len(set(out)) == len(out)
    # Best-first from the root: a hitter's parent is a hitter too, and it came first.
    pos = {k: i for i, k in enumerate(out)}
    for k in out:
        p = parents[keys.index(k)]
        assert p < 0 or pos.get(keys[p], len(out)) < pos[k]
    # Hottest first.
    assert [count_of[k] for k in out] == sorted((count_of[k] for k in out), reverse=True)
