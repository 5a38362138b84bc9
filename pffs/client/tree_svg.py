"""``pffs tree --svg``: the prefix tree as a standalone SVG (no scripts, fonts or links).

Drawn as an icicle: each session has a row; each run of pages is a bar
from where its parent's run ends, as wide as its pages (never narrower
than its label needs to be legible), as tall as the rows of the sessions
that share it, and darker the more sessions share it.  A session's name
and figures stand right of the bar where its pages end, in its own row, so
no two labels meet.  Every bar and name carries a tooltip (``<title>``)
with its exact figures.
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape, quoteattr

from pffs.client.prefixes import Branch, PrefixTree, Row
from pffs.client.tree_text import clean, elide, more, pages, sessions, span, width

ROW_H = 22
LEFT = 16
TOP = 78
PLOT_W = 640            # the deepest session's pages span about this many pixels
MIN_BAR = 30            # a bar is never narrower (one page of a long session still shows)
FONT = "DejaVu Sans, Verdana, Arial, sans-serif"
NAME_MAX = 60           # characters of a name shown (the tooltip has all of it)
_LIGHT = (222, 235, 247)
_DARK = (33, 94, 168)


def _text_w(s: str, size: float) -> float:
    """A generous estimate of *s*'s width in pixels (DejaVu Sans is wide)."""
    return width(s) * size * 0.6


def _colour(shared: int, most: int) -> tuple[str, str]:
    """Fill and text colour of a bar *shared* sessions hold (*most*: the most any bar has)."""
    t = 0.0 if most <= 1 else math.log(shared) / math.log(most)
    rgb = tuple(round(a + (b - a) * t) for a, b in zip(_LIGHT, _DARK))
    return "#%02x%02x%02x" % rgb, ("#ffffff" if t > 0.5 else "#08306b")


class _Canvas:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.right = 0.0

    def text(self, x: float, y: float, s: str, size: int = 12, fill: str = "#1a1a1a",
             extra: str = "", tip: str = "", span: float | None = None) -> None:
        """Text at (*x*, *y*); *span*: how far right it reaches (its estimated width by default)."""
        text = f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" fill="{fill}"{extra}>{escape(s)}</text>'
        self.parts.append(f"<g><title>{escape(tip)}</title>{text}</g>" if tip else text)
        self.right = max(self.right, x + (_text_w(s, size) if span is None else span))

    def runs(self, x: float, y: float, parts: list[tuple[str, int, str, bool]], tip: str) -> None:
        """One line of text in runs (text, size, colour, bold) that the renderer sets one
        after the other, 8 px apart, so none can overlap the next whatever the font."""
        spans = "".join(f'<tspan font-size="{size}" fill="{fill}"'
                        + (' font-weight="bold"' if bold else "") + (' dx="8"' if i else "")
                        + f">{escape(s)}</tspan>" for i, (s, size, fill, bold) in enumerate(parts))
        self.parts.append(f'<g><title>{escape(tip)}</title><text x="{x:.1f}" y="{y:.1f}">{spans}</text></g>')
        self.right = max(self.right, x + sum(_text_w(s, size) * (1.15 if bold else 1) + 8
                                             for s, size, _, bold in parts))

    def bar(self, x: float, y: float, w: float, h: float, fill: str, tip: str) -> None:
        self.parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="3"'
                          f' fill="{fill}" stroke="#ffffff" stroke-width="1">'
                          f"<title>{escape(tip)}</title></rect>")


def _fit(options: list[str], room: float, size: int) -> str | None:
    return next((o for o in options if _text_w(o, size) <= room), None)


def draw(title: str, tree: PrefixTree, rows: list[Row], *, differ: int = 0, missing: int = 0) -> str:
    """The SVG document, as text."""
    # Slots: one row each for a session's end or a "more" line, bars span theirs.
    slots: list[Row] = []
    spans: dict[int, tuple[int, int]] = {}       # id(row) -> first and last slot
    order: list[tuple[Row, Branch | None]] = []  # rows with their parent's node, parents first
    stack: list[tuple[Row, Branch | None, bool]] = [(r, None, False) for r in reversed(rows)]
    while stack:
        row, parent, done = stack.pop()
        if done:
            spans[id(row)] = (spans[id(row.children[0])][0], spans[id(row.children[-1])][1])
            continue
        order.append((row, parent))
        if row.kind == "branch" and row.children:
            stack.append((row, parent, True))
            stack.extend((c, row.node, False) for c in reversed(row.children))
        else:
            spans[id(row)] = (len(slots), len(slots))
            slots.append(row)
    deepest = max((r.node.depth_pages for r, _ in order if r.kind != "more"), default=1) or 1
    scale = PLOT_W / deepest
    right_of: dict[int, float] = {id(tree.root): LEFT}    # id(node) -> x where its run ends
    most = max((r.node.sessions for r, _ in order if r.kind in ("branch", "leaf")), default=1)
    c = _Canvas()
    for row, parent in order:
        if row.kind not in ("branch", "leaf"):
            continue
        b = row.node
        x0 = right_of[id(parent if parent is not None else tree.root)]
        w = max(MIN_BAR, b.n_pages * scale)
        right_of[id(b)] = x0 + w
        first, last = spans[id(row)]
        y, h = TOP + first * ROW_H + 1, (last - first + 1) * ROW_H - 2
        fill, ink = _colour(b.sessions, most)
        alone = row.kind == "leaf"
        tip = (f"{clean(row.name)}: " if alone else "") + f"{span(b.n_pages, b.n_tokens)} " + \
            ("alone" if alone else f"shared by {sessions(b.sessions)}") + \
            f"; pages {b.depth_pages - b.n_pages}–{b.depth_pages - 1}" + \
            ("" if alone or not b.children else f"; forks after {span(b.depth_pages, b.depth_tokens)}")
        c.bar(x0, y, w, h, fill, tip)
        room = w - 8
        full = f"{span(b.n_pages, b.n_tokens)}" + ("" if alone else f" · ×{b.sessions}")
        fork = f"fork after page {b.depth_pages} · {b.depth_tokens} tok" if not alone and b.children else ""
        short = [pages(b.n_pages) + ("" if alone else f" · ×{b.sessions}"), pages(b.n_pages),
                 f"{b.n_pages}" + ("" if alone else f" ×{b.sessions}"), str(b.n_pages)]
        line1 = _fit([full, *short], room, 11)
        up = _fit([f"{full} · {fork}" if fork else full, full, *short], h - 8, 11) if w >= 16 else None
        if up and len(up) > len(line1 or ""):
            # A tall narrow bar (a long shared run of few pages) says more upwards.
            c.text(0, 0, up, 11, ink, f' text-anchor="middle" transform="translate({x0 + w / 2 + 4:.1f},'
                   f'{y + h / 2:.1f}) rotate(-90)"', tip=tip, span=0)
            continue
        two = bool(fork) and h >= 2 * ROW_H - 2
        mid = y + h / 2
        if line1:
            c.text(x0 + 4, mid + (-2 if two else 4), line1, 11, ink, tip=tip)
        if two and line1:
            line2 = _fit([fork, f"fork after page {b.depth_pages}", f"fork @ {b.depth_pages}"], room, 10)
            if line2:
                c.text(x0 + 4, mid + 11, line2, 10, ink, tip=tip)
    for i, row in enumerate(slots):
        tx = right_of.get(id(row.node), LEFT) + 6
        ty = TOP + i * ROW_H + ROW_H / 2 + 4
        if row.kind == "more":
            c.text(tx, ty, more(row), 12, "#666666", ' font-style="italic"')
            continue
        b = row.node
        held = f"+{span(b.n_pages, b.n_tokens)} alone" if row.kind == "leaf" else "nothing alone"
        name = clean(row.name)
        c.runs(tx, ty, [(elide(name, NAME_MAX), 12, "#1a1a1a", True),
                        (f"{span(b.depth_pages, b.depth_tokens)} · {held}", 11, "#444444", False)],
               tip=f"{name}: {span(b.depth_pages, b.depth_tokens)}, {held}")
    head = [f"{clean(title)}", f"{sessions(tree.n_sessions)} · {pages(tree.listed_pages)} listed · "
            f"{tree.tree_pages} after sharing prefixes"
            + (f" · {differ} drawn from page files newer than manifest.json" if differ else "")
            + (f" · {missing} incomplete" if missing else ""),
            "Each bar is a run of pages the sessions in its rows share, from where its parent's ends;"
            " wider: more pages; darker: more sessions."]
    c.text(LEFT, 24, head[0], 15, "#1a1a1a", ' font-weight="bold"')
    c.text(LEFT, 44, head[1], 12, "#333333")
    c.text(LEFT, 62, head[2], 11, "#666666")
    w = math.ceil(c.right + LEFT)
    h = TOP + len(slots) * ROW_H + 16
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}"'
            f' font-family={quoteattr(FONT)}>\n'
            f"<title>{escape(clean(title))}: prefix tree</title>\n"
            f'<rect width="{w}" height="{h}" fill="#ffffff"/>\n'
            + "\n".join(c.parts) + "\n</svg>\n")
