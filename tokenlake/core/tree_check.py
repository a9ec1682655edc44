"""The structural invariants of the prefix tree, asserted (for tests): what
:meth:`tokenlake.core.prefix_tree.PrefixTree.check` runs besides the eviction index's own
check (:meth:`tokenlake.core.tree_lru.EvictionIndex.check`). The tree keeps:

* every non-root node's parent is in the tree (no orphaned suffix), and every node is
  reachable from one virtual root: the unsalted one, or the root of one salt, which
  exists exactly while it has children;
* a node with a child in a slab, a pin or a lease is never removed; a node without a
  replica is held only in the disk tier, and so are its children;
* every node counts its children with a replica (``fast_kids``);
* the LRU index holds exactly the replicas that may be evicted now: ready replicas of
  unpinned, unleased nodes that either have no child in a slab or have another ready
  replica; it is kept per instance (eviction at a segment's home picks that
  instance's oldest);
* a node with two or more children holds their token bytes sorted (children inserted
  without tokens take no part in page hits).
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenlake.core.segments import SegmentKey
from tokenlake.core.tree_nodes import TreeNode


def check_tree(nodes: Mapping[SegmentKey, TreeNode], root: TreeNode,
               roots: Mapping[SegmentKey, TreeNode], unsalted: SegmentKey) -> None:
    """Asserts that ``nodes`` (by key) hang under ``root`` (the unsalted virtual root,
    whose key is ``unsalted``) and ``roots`` (the salts' virtual roots, by key): no
    orphaned suffix, children links and indices agree both ways, one replica per
    instance, every salt's root has children, and every node is reachable from a root."""
    for node in nodes.values():
        parent = node.parent
        assert (parent is None or parent in nodes
                or (node.index == 0 and parent in roots)), "orphaned suffix"
        node.check_links(root if parent is None else nodes.get(parent) or roots[parent], nodes)
        assert len({r.instance for r in node.replicas}) == len(node.replicas)
        kids = node.child_nodes()
        assert node.fast_kids == sum(bool(k.replicas) for k in kids), "fast_kids out of date"
        assert node.replicas or (node.tier is not None and not node.fast_kids), \
            "a node without a replica is not held only in the tier"
    assert all(nodes.get(n.key) is n for n in root.child_nodes())
    root.check_links(None, nodes)
    for rkey, salted in roots.items():
        assert (salted.key, salted.parent, salted.index, salted.tokens) == (rkey, None, -1, None)
        assert not salted.replicas and rkey not in nodes and rkey != unsalted
        assert salted.has_children, "a salt's root without segments is kept"
        salted.check_links(None, nodes, salted=True)
    # every node is reachable from a root (indices grow by one from parent to child,
    # checked above, so this walk ends; each node is one parent's child)
    seen, stack = 0, [root, *roots.values()]
    while stack:
        kids = stack.pop().child_nodes()
        seen += len(kids)
        stack += kids
    assert seen == len(nodes), "a node is not reachable from a root"
