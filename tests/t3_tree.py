"""Level t3, mounts: ``pffs tree`` on a real mount.
Sessions forked with ``pffs fork`` and ``cp -r``, suffixes of their pages
rewritten (sealed or not), drawn as the tree of the prefixes they share: as
text that fits 100 columns, and as an SVG that ``rsvg-convert`` renders."""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
import zlib
from collections import Counter
from pathlib import Path

import pytest

from mountutil import pffs
from pffs import manifest as mf
from sessions import make_manifest, varied_pages, write_session

TOK = 16      # tokens a page (sessions.GEOMETRY)


def run(*cmd, cwd=None) -> str:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, timeout=300)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}: {r.stderr}"
    return r.stdout


def rewrite(session: Path, new: dict[int, bytes]) -> None:
    """Write pages over a session's page files, as an engine continuing it would."""
    for ix, data in new.items():
        (session / "pages" / mf.page_name(ix)).write_bytes(data)


# -- a small tree, every figure known --------------------------------------------

EXPECTED = """\
team
7 sessions · 36 pages listed · 13 after sharing prefixes
1 session: page files differ from manifest.json, drawn as the files are (see pffs seal)
├─┬ 3 pages (48 tok) shared by 6 · forks after 3 pages (48 tok)
│ ├── short     nothing alone · 3 pages (48 tok) in all
│ └─┬ +1 page (16 tok) shared by 5 · forks after 4 pages (64 tok)
│   ├─┬ +1 page (16 tok) shared by 3 · forks after 5 pages (80 tok)
│   │ ├─┬ +1 page (7 tok) shared by 2 · the same 6 pages (87 tok) in each
│   │ │ ├── b   nothing alone · 6 pages (87 tok) in all
│   │ │ └── b2  nothing alone · 6 pages (87 tok) in all
│   │ └── base  +1 page (7 tok) alone · 6 pages (87 tok) in all
│   └─┬ +1 page (16 tok) shared by 2 · forks after 5 pages (80 tok)
│     ├── a     +1 page (7 tok) alone · 6 pages (87 tok) in all
│     └── c     +1 page (7 tok) alone · 6 pages (87 tok) in all
└── lone        3 pages (48 tok) alone · 3 pages (48 tok) in all
"""


def test_a_small_tree_shows_its_forks_and_figures(mnt, bf16_pages):
    A = varied_pages(bf16_pages, 6, salt=1)
    B, C, D, E = (varied_pages(bf16_pages, 6, salt=s) for s in (2, 3, 4, 5))
    team = mnt / "team"
    team.mkdir()
    write_session(team / "base", A, fill=7)                 # 87 tokens: the last page holds 7
    run("cp", "-r", team / "base", team / "a")
    rewrite(team / "a", {4: B[4], 5: B[5]})
    pffs("seal", team / "a")
    pffs("fork", team / "base", team / "b")
    rewrite(team / "b", {5: C[5]})
    pffs("seal", team / "b")
    run("cp", "-r", team / "b", team / "b2")                # the same pages as b
    pffs("fork", team / "a", team / "c")
    rewrite(team / "c", {5: D[5]})                          # not sealed: drawn as its files are
    write_session(team / "short", A[:3])                    # a prefix of base's pages
    write_session(team / "lone", E[:3])
    (team / "notes").mkdir()                                # a plain folder, no session

    out = pffs("tree", team).stdout
    assert out == EXPECTED.replace("team", str(team), 1)
    assert all(len(line) <= 100 for line in out.splitlines())

    # Sealing c draws it from its manifest alike, and the note goes.
    pffs("seal", team / "c")
    assert pffs("tree", team).stdout.splitlines()[2].startswith("├─┬ 3 pages (48 tok) shared by 6")

    # Three lines at most below the first: the biggest branch that fits, what
    # it leaves out, and the next that fits.
    lines = pffs("tree", team, "--lines", "3").stdout.splitlines()
    assert lines[2:] == ["├─┬ 3 pages (48 tok) shared by 6 · forks after 3 pages (48 tok)",
                         "│ └── … 6 more sessions: 1 ends here, 5 in 1 branch (7 pages)",
                         "└── lone  3 pages (48 tok) alone · 3 pages (48 tok) in all"]


def test_bad_paths_get_one_line(mnt, bf16_pages, tmp_path):
    write_session(mnt / "s", varied_pages(bf16_pages, 1))
    for args, why in (((tmp_path,), "not inside a mounted pffs"),
                      ((mnt / "s" / "manifest.json",), "not a directory"),
                      ((mnt / "nowhere",), "no such file or directory"),
                      ((mnt.path, "--lines", "-1"), "--lines takes a number >= 0")):
        r = pffs("tree", *args, check=False)
        assert r.returncode == 1 and r.stdout == "", (args, r)
        assert r.stderr.count("\n") == 1 and why in r.stderr, (args, r.stderr)
    r = pffs("tree", check=False, cwd=tmp_path)
    assert r.returncode == 1 and "not inside a mounted pffs (give a folder of one)" in r.stderr
    r = pffs("tree", mnt.path, "--svg", tmp_path / "no" / "such" / "folder.svg", check=False)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "No such file or directory" in r.stderr


# -- fifty sessions forked in a tree -------------------------------------------------

def _fork_tree(mnt, bf16_pages, n=50) -> dict[str, list[bytes]]:
    """*n* sessions under fleet/: a root of 8 pages, then forks of random earlier
    sessions by ``pffs fork`` or ``cp -r``, each keeping a prefix of its parent's
    pages and rewriting, adding or dropping the rest, then sealed or given a new
    manifest.json; the last three rewrite their last page and stay unsealed."""
    rnd = random.Random(7)
    fresh = iter(varied_pages(bf16_pages, 4 * n, salt=50))
    fleet = mnt / "fleet"
    (fleet / "team-b").mkdir(parents=True)
    model: dict[str, list[bytes]] = {"root": [next(fresh) for _ in range(8)]}
    write_session(fleet / "root", model["root"])
    parents = ["root"]
    for i in range(1, n):
        name = f"s{i:02d}" if i % 3 else f"team-b/s{i:02d}"
        if i % 10 == 0:
            name = f"{'an-experiment-with-a-long-name-' * 4}{i:02d}"     # (cut in the drawing)
        parent = rnd.choice(parents)
        old = model[parent]
        unsealed = i >= n - 3
        if unsealed:
            new = old[:-1] + [next(fresh)]
        else:
            keep = rnd.randint(max(1, len(old) - 3), len(old))
            new = old[:keep] + [next(fresh) for _ in range(rnd.randint(0 if keep < len(old) else 1, 3))]
        src, dst = fleet / parent, fleet / name
        if i % 2:
            pffs("fork", src, dst)
        else:
            run("cp", "-r", src, dst)
        rewrite(dst, {ix: new[ix] for ix in range(len(new)) if ix >= len(old) or new[ix] != old[ix]})
        for ix in range(len(new), len(old)):
            (dst / "pages" / mf.page_name(ix)).unlink()
        if not unsealed:
            if len(new) == len(old) and i % 4:
                pffs("seal", dst)
            else:
                (dst / "manifest.json").write_bytes(make_manifest(new).to_json())
            parents.append(name)
        model[name] = new
    return model


def _expected(model: dict[str, list[bytes]]):
    """Branch points, by brute force over prefixes: (sessions sharing, pages deep) of
    each, and what each session holds alone."""
    ids: dict[bytes, int] = {}
    seqs = {name: tuple(ids.setdefault(p, len(ids)) for p in pages) for name, pages in model.items()}
    branches = Counter()
    prefixes = {s[:k] for s in seqs.values() for k in range(1, len(s) + 1)}
    for p in prefixes:
        holders = [s for s in seqs.values() if s[:len(p)] == p]
        nexts = {s[len(p)] for s in holders if len(s) > len(p)}
        ends = sum(1 for s in holders if s == p)
        if len(holders) >= 2 and (len(nexts) >= 2 or ends >= 1):
            branches[(len(holders), len(p))] += 1

    def lcp(a, b):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return k
    alone = {name: len(s) - max(lcp(s, t) for other, t in seqs.items() if other != name)
             for name, s in seqs.items()}
    return branches, alone, len(prefixes)


BRANCH = re.compile(r"[├└]─┬ \+?\d+ pages? \(\d+ tok\) shared by (\d+) · "
                    r"(?:forks after|the same) (\d+) pages? \((\d+) tok\)")
NAMED = re.compile(r"[├└]── (\S+) +(.*)$")


@pytest.fixture
def fleet(mnt, bf16_pages):
    return mnt, _fork_tree(mnt, bf16_pages)


def test_fifty_forked_sessions_drawn_in_100_columns(fleet, tmp_path):
    mnt, model = fleet
    branches, alone, distinct = _expected(model)
    out = pffs("tree", mnt / "fleet", "--lines", "0").stdout.splitlines()
    assert all(len(line) <= 100 for line in out), max(out, key=len)
    assert out[:2] == [str(mnt / "fleet"), f"50 sessions · {sum(map(len, model.values()))} pages listed"
                       f" · {distinct} after sharing prefixes"]
    assert out[2] == "3 sessions: page files differ from manifest.json, drawn as the files are (see pffs seal)"
    found = Counter()
    for line in out[3:]:
        m = BRANCH.search(line)
        if m:
            found[(int(m[1]), int(m[2]))] += 1
            assert int(m[3]) == TOK * int(m[2])
    assert found == branches and sum(branches.values()) >= 10
    named = {}
    for line in out[3:]:
        if m := NAMED.search(line):
            # A name too long for its line is cut in the middle.
            head, cut, tail = m[1].partition("…")
            (full,) = [n for n in model if n == m[1] or cut and n.startswith(head) and n.endswith(tail)]
            named[full] = m[2]
    assert set(named) == set(model)
    for name, text in named.items():
        n = len(model[name])
        held = (f"+{alone[name]} page{'s' * (alone[name] != 1)} ({TOK * alone[name]} tok) alone"
                if alone[name] else "nothing alone")
        assert text == f"{held} · {n} page{'s' * (n != 1)} ({TOK * n} tok) in all", name

    # By default the biggest branches in at most 60 lines, the rest counted.
    short = pffs("tree", cwd=mnt / "fleet" / "team-b").stdout.splitlines()
    assert short[:2] == [str(mnt.path), out[1]]
    assert 10 < len(short) <= 63 and all(len(line) <= 100 for line in short)
    drawn = sum(1 for line in short[3:] if NAMED.search(line) and "more session" not in line)
    hidden = sum(int(m[1]) for line in short if (m := re.search(r"… (\d+) more sessions?:", line)))
    assert hidden > 0 and drawn + hidden == 50


def test_fifty_forked_sessions_as_svg_a_renderer_draws(fleet, tmp_path):
    if shutil.which("rsvg-convert") is None:
        pytest.fail("rsvg-convert missing: scripts/setup.sh installs librsvg2-bin")
    mnt, model = fleet
    svg, png = tmp_path / "fleet.svg", tmp_path / "fleet.png"
    r = pffs("tree", mnt / "fleet", "--svg", svg)
    assert r.stdout == f"{svg}: 50 sessions, 50 drawn by name\n"
    text = svg.read_text()
    root = ET.fromstring(text)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    # Standalone: nothing fetched (no links, images, scripts, styles from elsewhere).
    assert not re.search(r"href|<image|<script|@import|url\(", text)
    # Every session is named in the picture, in full in its tooltip (long ones cut on the page).
    ns = "{http://www.w3.org/2000/svg}"
    words = {t.text for t in root.iter() if t.tag in (f"{ns}text", f"{ns}tspan") and t.text}
    tips = {t.text.partition(": ")[0] for t in root.iter(f"{ns}title") if t.text}
    assert set(model) <= tips
    assert {n for n in model if len(n) < 60} <= words
    assert sum(1 for w in words if "…" in w) == sum(1 for n in model if len(n) > 60)
    run("rsvg-convert", svg, "-o", png)
    if os.environ.get("PFFS_TREE_PNG"):
        shutil.copy(png, os.environ["PFFS_TREE_PNG"])    # (to look at it)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    try:
        from PIL import Image
    except ImportError:
        # No PIL: the decompressed pixel rows hold many distinct byte values.
        idat, pos = b"", 8
        while pos < len(data):
            size = int.from_bytes(data[pos:pos + 4], "big")
            if data[pos + 4:pos + 8] == b"IDAT":
                idat += data[pos + 8:pos + 8 + size]
            pos += 12 + size
        assert len(set(zlib.decompress(idat))) > 50
        return
    with Image.open(png) as im:
        rgb = im.convert("RGB")
    width, height = rgb.size
    assert width >= 600 and height >= 50 * 22
    colours = rgb.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 20     # bars in several shades and text
    dark = sum(n for n, c in colours if sum(c) < 384)
    assert 0.02 < dark / (width * height) < 0.9          # not a blank page, not all ink
    blue = sum(n for n, (r, g, b) in colours if b - r > 40)
    assert blue / (width * height) > 0.08                 # the bars (text alone is grey)
