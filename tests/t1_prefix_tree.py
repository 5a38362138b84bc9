"""Level t1, units: no mount and no engine.
``pffs tree``'s parts on made-up digests: the trie of shared prefixes, the
rows chosen for a number of lines, the text drawing's width and the SVG's
well-formedness, the tokens a manifest gives each page."""

from __future__ import annotations

import random
import xml.etree.ElementTree as ET

from pffs import manifest as mf
from pffs.client import prefixes, tree_svg, tree_text
from pffs.client.digests import page_tokens


def d(*ns: int) -> list:
    return [f"sha256:{n:064x}" for n in ns]


def build(spec: dict[str, list[int]]) -> prefixes.PrefixTree:
    return prefixes.build((name, d(*ids), [16] * len(ids)) for name, ids in spec.items())


def test_forks_part_edges_and_ends_sit_where_sessions_stop():
    t = build({"base": [1, 2, 3, 4], "a": [1, 2, 3, 4, 5, 6], "b": [1, 2, 7], "b2": [1, 2, 7], "x": [9]})
    (first, lone) = t.root.ordered_children()
    assert (first.n_pages, first.sessions, first.depth_pages) == (2, 4, 2)
    assert (lone.n_pages, lone.ends, lone.is_leaf) == (1, ["x"], True)
    three, seven = first.ordered_children()
    assert (three.n_pages, three.ends, three.depth_pages, three.sessions) == (2, ["base"], 4, 2)
    assert (seven.n_pages, seven.ends, seven.children) == (1, ["b", "b2"], {})
    (tail,) = three.children.values()
    assert (tail.n_pages, tail.depth_pages, tail.ends) == (2, 6, ["a"])
    assert (t.n_sessions, t.listed_pages, t.tree_pages) == (5, 17, 8)


def test_rows_fit_the_lines_asked_and_count_every_session():
    rnd = random.Random(3)
    spec: dict[str, list[int]] = {"root": list(range(8))}
    fresh = iter(range(100, 10**6))
    for i in range(300):
        old = spec[rnd.choice(sorted(spec))]
        spec[f"s{i}"] = old[:rnd.randint(1, len(old))] + [next(fresh) for _ in range(rnd.randint(0, 3))]
    t = build(spec)
    for n in list(range(1, 40)) + [60, 200, 0]:
        rows = prefixes.layout(t, n)
        drawn = list(prefixes.walk_rows(rows))
        assert n == 0 or len(drawn) <= n
        named = sum(1 for r in drawn if r.kind in ("leaf", "end"))
        hidden = sum(r.hidden_ends + r.hidden_sessions for r in drawn if r.kind == "more")
        assert named + hidden == 301, n
        assert n != 0 or hidden == 0
    # More lines never show fewer sessions.
    shown = [sum(1 for r in prefixes.walk_rows(prefixes.layout(t, n)) if r.kind in ("leaf", "end"))
             for n in (10, 30, 60, 120)]
    assert shown == sorted(shown) and shown[0] < shown[-1]


def test_a_chain_thousands_deep_and_odd_names_fit_100_columns():
    n = 3000
    chain = {f"turn-{i:04d}": list(range(i + 1)) for i in range(n)}
    chain["名前" * 40 + "\x07\udcff"] = [0, 1, 10**6]
    t = build(chain)                          # (no recursion: it would overflow)
    lines = tree_text.draw("/mnt/" + "deep/" * 40, t, prefixes.layout(t, 0))
    assert len(lines) > n
    assert max(tree_text.width(line) for line in lines) <= 100
    assert not any(c in line for line in lines for c in "\x07\udcff")
    svg = tree_svg.draw("deep\x01", t, prefixes.layout(t, 300))
    ET.fromstring(svg)                        # well-formed XML: no control characters in it


def test_elide_keeps_both_ends_within_the_width():
    assert tree_text.elide("abcdefghij", 10) == "abcdefghij"
    assert tree_text.elide("abcdefghijkl", 7) == "abc…jkl"
    assert tree_text.width(tree_text.elide("名前" * 20, 11)) <= 11


def test_tokens_per_page_come_from_the_sequences():
    m = mf.Manifest(page_size_tokens=16, n_layers=1, n_heads=1, head_dim=8, dtype="bf16",
                    pages=d(1, 2, 3, 4),
                    logical_seqs=[mf.LogicalSeq("a", [0, 1, 2], 5), mf.LogicalSeq("b", [0, 3], 0)])
    assert page_tokens(m) == [16, 16, 5, 16]
    m.logical_seqs = []
    assert page_tokens(m) == [16, 16, 16, 16]
