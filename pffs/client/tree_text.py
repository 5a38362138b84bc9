"""``pffs tree``'s drawing for a terminal: the prefix tree as ``tree`` draws folders.

Every line fits the width (100 columns by default): session names are cut
in the middle (``…``), and levels deeper than the drawing has room for are
cut at the left.  Numbers are exact; "tok" are tokens.
"""

from __future__ import annotations

import unicodedata

from pffs.client.prefixes import PrefixTree, Row

WIDTH = 100
_MAX_INDENT = 40        # columns of tree lines before a deeper level is cut at the left
_MIN_NAME = 12


def width(s: str) -> int:
    """Columns *s* takes in a terminal (wide East Asian characters take two)."""
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
               for c in s)


def _cut_end(s: str, w: int) -> str:
    if width(s) <= w:
        return s
    out, n = [], 0
    for c in s:
        cw = width(c)
        if n + cw > w - 1:
            break
        out.append(c)
        n += cw
    return "".join(out) + "…"


def elide(s: str, w: int) -> str:
    """*s* in at most *w* columns, its middle replaced by ``…`` when it must be."""
    if width(s) <= w:
        return s
    if w <= 1:
        return "…"[:w]
    head = _cut_end(s, (w + 1) // 2)[:-1]
    tail, n = [], 0
    for c in reversed(s):
        cw = width(c)
        if n + cw > w - 1 - width(head):
            break
        tail.append(c)
        n += cw
    return head + "…" + "".join(reversed(tail))


def clean(name: str) -> str:
    """A name as a terminal (and XML) can show it: control characters,
    undecodable bytes and non-characters as ``?``."""
    return "".join("?" if unicodedata.category(c) in ("Cc", "Cs", "Cf", "Cn", "Zl", "Zp") else c
                   for c in name)


def pages(n: int) -> str:
    return f"{n} page" if n == 1 else f"{n} pages"


def sessions(n: int) -> str:
    return f"{n} session" if n == 1 else f"{n} sessions"


def span(n_pages: int, n_tokens: int) -> str:
    return f"{pages(n_pages)} ({n_tokens} tok)"


def label(row: Row, top: bool) -> str:
    """What a row says after its tree lines (and after the name, for a session's row)."""
    b = row.node
    plus = "" if top else "+"
    if row.kind == "branch":
        where = f"forks after {span(b.depth_pages, b.depth_tokens)}" if b.children \
            else f"the same {span(b.depth_pages, b.depth_tokens)} in each"
        return f"{plus}{span(b.n_pages, b.n_tokens)} shared by {b.sessions} · {where}"
    if row.kind == "leaf":
        return f"{plus}{span(b.n_pages, b.n_tokens)} alone · {span(b.depth_pages, b.depth_tokens)} in all"
    if row.kind == "end":
        return f"nothing alone · {span(b.depth_pages, b.depth_tokens)} in all"
    return more(row)


def more(row: Row) -> str:
    """A ``more`` row: what was left out."""
    parts = []
    if row.hidden_ends:
        parts.append(f"{row.hidden_ends} {'ends' if row.hidden_ends == 1 else 'end'} here")
    if row.hidden_branches:
        parts.append(f"{row.hidden_sessions} in {row.hidden_branches}"
                     f" {'branch' if row.hidden_branches == 1 else 'branches'} ({pages(row.hidden_pages)})")
    n = row.hidden_ends + row.hidden_sessions
    return f"… {n} more {'session' if n == 1 else 'sessions'}: " + ", ".join(parts)


def header(title: str, tree: PrefixTree, differ: int = 0, missing: int = 0, w: int = WIDTH) -> list[str]:
    """The folder drawn, its figures, and what the drawing could not take from the manifests."""
    lines = [elide(clean(title), w), f"{sessions(tree.n_sessions)} · {pages(tree.listed_pages)} listed · "
             f"{tree.tree_pages} after sharing prefixes"]
    if differ:
        lines.append(f"{sessions(differ)}: page files differ from manifest.json, drawn as the files are"
                     " (see pffs seal)")
    if missing:
        lines.append(f"{sessions(missing)} incomplete (page files missing), drawn as manifest.json lists them")
    return [_cut_end(line, w) for line in lines]


def _indent(cont: str) -> str:
    return cont if len(cont) <= _MAX_INDENT else "…" + cont[-(_MAX_INDENT - 1):]


def draw(title: str, tree: PrefixTree, rows: list[Row], *, differ: int = 0, missing: int = 0,
         w: int = WIDTH) -> list[str]:
    """The drawing's lines, each at most *w* columns."""
    placed: list[tuple[str, Row, bool]] = []      # (tree lines, row, at the top level)
    stack = [(r, "", i == len(rows) - 1) for i, r in reversed(list(enumerate(rows)))]
    while stack:
        row, cont, last = stack.pop()
        joint = ("└" if last else "├") + ("─┬ " if row.kind == "branch" else "── ")
        placed.append((_indent(cont + joint), row, cont == ""))
        under = cont + ("  " if last else "│ ")
        n = len(row.children)
        stack.extend((c, under, i == n - 1) for i, c in reversed(list(enumerate(row.children))))
    named = [(lines, row, top) for lines, row, top in placed if row.kind in ("leaf", "end")]
    # Sessions' figures start in one column, as far left as the names allow.
    col = 0
    if named:
        widest = max(width(label(r, top)) for _, r, top in named)
        longest = max(width(lines) + width(clean(r.name)) for lines, r, _ in named)
        col = max(0, min(longest + 2, w - widest))
    out = header(title, tree, differ, missing, w)
    for lines, row, top in placed:
        text = label(row, top)
        if row.kind in ("leaf", "end"):
            room = col - width(lines) - 2
            if room >= _MIN_NAME or width(clean(row.name)) <= room:
                name = elide(clean(row.name), room)
                line = lines + name + " " * (col - width(lines) - width(name)) + text
            else:
                line = lines + elide(clean(row.name), _MIN_NAME) + "  " + text
        else:
            line = lines + text
        out.append(_cut_end(line, w))
    return out

