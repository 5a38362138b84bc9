"""The tree of shared prefixes of sessions: a trie over page digests in page order.

Two sessions share a prefix of k pages when their first k pages have the
same digests.  Chains of pages that every session passing through them
holds alike are one edge (a radix trie), so a node is where sessions part
or end.  Built from digests alone: no page bytes.  Every walk here is
iterative, since a chain of sessions each one page longer than the last
nests as deep as it is long.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from pffs.types import Digest


@dataclass(eq=False)
class Branch:
    """A node: the run of pages from its parent, and what parts or ends after it."""

    pages: list[Digest]
    tokens: list[int]                    # tokens each of those pages holds
    children: dict[Digest, "Branch"] = field(default_factory=dict)
    ends: list[str] = field(default_factory=list)   # sessions whose pages end here
    # Filled by PrefixTree.finish():
    depth_pages: int = 0                 # pages from the root to this node's end
    depth_tokens: int = 0
    sessions: int = 0                    # sessions ending here or below
    below_pages: int = 0                 # pages on the edges of this node and below it
    first: str = ""                      # the least session name here or below (an order for ties)

    @property
    def n_pages(self) -> int:
        return len(self.pages)

    @property
    def n_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def is_leaf(self) -> bool:
        """One session's own end: no other session goes on from here or ends here."""
        return not self.children and len(self.ends) == 1

    def ordered_children(self) -> list["Branch"]:
        """Biggest first: most sessions, then most pages, then by first name."""
        return sorted(self.children.values(), key=lambda b: (-b.sessions, -b.below_pages, b.first))


class PrefixTree:
    """Sessions' page digests as a radix trie; ``root`` holds no pages."""

    def __init__(self) -> None:
        self.root = Branch([], [])
        self.n_sessions = 0
        self.listed_pages = 0            # pages the sessions list, counted per session

    def add(self, name: str, pages: list[Digest], tokens: list[int]) -> None:
        """Insert one session's pages (in page order) and the tokens each holds."""
        if len(pages) != len(tokens):
            raise ValueError("one token count per page")
        self.n_sessions += 1
        self.listed_pages += len(pages)
        node, i, n = self.root, 0, len(pages)
        while i < n:
            child = node.children.get(pages[i])
            if child is None:
                leaf = Branch(list(pages[i:]), list(tokens[i:]))
                node.children[pages[i]] = leaf
                node = leaf
                break
            j, run = 1, child.pages       # (run[0] == pages[i]: it is the key)
            while j < len(run) and i + j < n and run[j] == pages[i + j]:
                j += 1
            if j < len(run):
                # Part the edge where this session leaves it (or ends in it).
                mid = Branch(run[:j], child.tokens[:j])
                child.pages, child.tokens = run[j:], child.tokens[j:]
                mid.children[child.pages[0]] = child
                node.children[pages[i]] = mid
                child = mid
            node, i = child, i + j
        node.ends.append(name)

    def finish(self) -> "PrefixTree":
        """Reckon depths and counts (call once every session is added)."""
        order = list(self.walk())
        for node, parent in order:
            if parent is not None:
                node.depth_pages = parent.depth_pages + node.n_pages
                node.depth_tokens = parent.depth_tokens + node.n_tokens
            node.ends.sort()
        for node, _ in reversed(order):
            node.sessions = len(node.ends) + sum(c.sessions for c in node.children.values())
            node.below_pages = node.n_pages + sum(c.below_pages for c in node.children.values())
            node.first = min([*node.ends[:1], *(c.first for c in node.children.values())], default="")
        return self

    def walk(self) -> Iterator[tuple[Branch, Branch | None]]:
        """Every node with its parent, parents first."""
        stack: list[tuple[Branch, Branch | None]] = [(self.root, None)]
        while stack:
            node, parent = stack.pop()
            yield node, parent
            stack.extend((c, node) for c in node.children.values())

    @property
    def tree_pages(self) -> int:
        """Pages once each shared prefix is counted once."""
        return self.root.below_pages


def build(sessions: Iterable[tuple[str, list[Digest], list[int]]]) -> PrefixTree:
    t = PrefixTree()
    for name, pages, tokens in sessions:
        t.add(name, pages, tokens)
    return t.finish()


# -- what a drawing shows ------------------------------------------------------

@dataclass(eq=False)
class Row:
    """One line of a drawing.

    ``kind``: ``"branch"`` (an edge several sessions share, or after which
    some end: ``node``), ``"leaf"`` (an edge one session holds alone:
    ``node``, its name ``name``), ``"end"`` (a session ending where others
    go on, or one of identical ones: ``name`` at ``node``) or ``"more"``
    (what was left out: ``hidden_sessions`` in ``hidden_branches``).
    """

    kind: str
    node: Branch
    name: str = ""
    children: list["Row"] = field(default_factory=list)
    hidden_ends: int = 0
    hidden_sessions: int = 0
    hidden_branches: int = 0
    hidden_pages: int = 0


def _sub_rows(node: Branch) -> list[Row]:
    """What a node's line has under it, in drawing order: sessions ending there, then branches."""
    rows = [Row("end", node, name) for name in node.ends]
    for c in node.ordered_children():
        rows.append(Row("leaf", c, c.ends[0]) if c.is_leaf else Row("branch", c))
    return rows


def _weight(row: Row) -> int:
    return 1 if row.kind == "end" else row.node.sessions


def layout(tree: PrefixTree, max_rows: int = 0) -> list[Row]:
    """The rows under the root to draw, at most *max_rows* of them with the
    ``more`` rows (0: all).  The biggest branches are kept: rows are taken
    greediest first (most sessions), each once its parent is in and if it
    fits, and what is left out is counted in a ``more`` row where it hangs."""
    top = _sub_rows(tree.root)
    if max_rows <= 0:
        stack = list(top)
        while stack:
            r = stack.pop()
            if r.kind == "branch":
                r.children = _sub_rows(r.node)
                stack.extend(r.children)
        return top
    tie = itertools.count()
    heap: list[tuple[int, int, Row, Row | None]] = [(-_weight(r), next(tie), r, None) for r in top]
    heapq.heapify(heap)
    kids: dict[int, list[Row]] = {}     # id(row) -> its sub-rows, taken or not
    left: dict[int | None, int] = {None: len(top)}    # sub-rows not taken yet (None: the top's)
    shown: set[int] = set()
    total = 1 if top else 0             # rows drawn: those taken and a "more" row per part left out
    while heap:
        _, _, r, parent = heapq.heappop(heap)
        key = None if parent is None else id(parent)
        # Taking r draws it, and a "more" row under it if it is a branch (none
        # of its own taken yet); its parent's "more" row goes with the last one.
        grow = 1 + (r.kind == "branch") - (left[key] == 1)
        if total + grow > max_rows:
            continue        # (a smaller row may still fit)
        total += grow
        left[key] -= 1
        shown.add(id(r))
        if r.kind == "branch":
            kids[id(r)] = _sub_rows(r.node)
            left[id(r)] = len(kids[id(r)])
            for k in kids[id(r)]:
                heapq.heappush(heap, (-_weight(k), next(tie), k, r))
    return _assemble(tree.root, top, kids, shown)


def _assemble(root: Branch, top: list[Row], kids: dict[int, list[Row]], shown: set[int]) -> list[Row]:
    def pick(at: Branch, rows: list[Row]) -> list[Row]:
        keep = [r for r in rows if id(r) in shown]
        hidden = [r for r in rows if id(r) not in shown]
        if hidden:
            keep.append(Row("more", at, hidden_ends=sum(1 for r in hidden if r.kind == "end"),
                            hidden_sessions=sum(r.node.sessions for r in hidden if r.kind != "end"),
                            hidden_branches=sum(1 for r in hidden if r.kind != "end"),
                            hidden_pages=sum(r.node.below_pages for r in hidden if r.kind != "end")))
        return keep
    out = pick(root, top)
    stack = [r for r in out if r.kind == "branch"]
    while stack:
        r = stack.pop()
        r.children = pick(r.node, kids.get(id(r), []))
        stack.extend(c for c in r.children if c.kind == "branch")
    return out


def walk_rows(rows: list[Row]) -> Iterator[Row]:
    """Every row, in drawing order."""
    stack = list(reversed(rows))
    while stack:
        r = stack.pop()
        yield r
        stack.extend(reversed(r.children))
