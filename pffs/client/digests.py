"""Each session's page digests in page order, read from a mount without page bytes.

A session's manifest.json lists its pages' digests; the session folder's
``user.pffs.pages`` attribute says, in one request, which page files do not
hold what it lists (rewritten since, missing, or too large for one blob).
Only those are asked for their own digest (``user.pffs.digest``, which the
namespace knows), so a session whose pages were rewritten and not sealed is
drawn as its files are.  A page file that is missing (a copy still under
way) counts as the page its manifest lists.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from pffs import manifest as mf
from pffs.errors import PffsError
from pffs.maint.prune import find_sessions
from pffs.names import DIGEST_XATTR, PAGES_DIR, PAGES_XATTR
from pffs.types import Digest

_NO_ATTR = (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP)


@dataclass
class SessionPages:
    name: str                   # the folder's path from the top folder drawn
    pages: list[Digest]         # page i's digest
    tokens: list[int]           # tokens page i holds (manifest: sequences, fill)
    differ: int = 0             # page files whose bytes are not what manifest.json lists
    missing: int = 0            # listed page files that are not there


def page_tokens(m: mf.Manifest) -> list[int]:
    """Tokens each page holds: the most any sequence uses it for (a full
    page, or ``fill_in_last_page`` of its last); every page full when the
    manifest names no sequence."""
    size = m.page_size_tokens
    if not m.logical_seqs:
        return [size] * len(m.pages)
    out = [0] * len(m.pages)
    for seq in m.logical_seqs:
        last = len(seq.page_ixs) - 1
        for k, ix in enumerate(seq.page_ixs):
            used = seq.fill_in_last_page if k == last and seq.fill_in_last_page else size
            out[ix] = max(out[ix], used)
    return out


def _bad_pages(folder: Path, n: int) -> list[int] | None:
    """The pages whose files do not hold what the manifest lists (None: every page may)."""
    try:
        verdict = json.loads(os.getxattr(folder, PAGES_XATTR))
    except OSError as e:
        if e.errno in _NO_ATTR:
            return None      # (a manifest with no page list to check against)
        raise
    bad = [int(ix) for ix in verdict.get("bad", [])]
    if verdict.get("more"):
        bad += range((bad[-1] + 1) if bad else 0, n)      # (the list was cut short)
    return bad


def read_session(folder: Path, name: str) -> SessionPages | None:
    """*folder*'s pages, or None when its manifest.json went meanwhile."""
    try:
        m = mf.parse((folder / mf.MANIFEST_NAME).read_bytes())
    except FileNotFoundError:
        return None
    except mf.ManifestError as e:
        raise PffsError(f"{folder / mf.MANIFEST_NAME}: {e}") from None
    out = SessionPages(name, list(m.pages), page_tokens(m))
    n = len(m.pages)
    bad = _bad_pages(folder, n)
    for ix in range(n) if bad is None else bad:
        path = folder / PAGES_DIR / mf.page_name(ix)
        try:
            d = Digest(os.getxattr(path, DIGEST_XATTR).decode())
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR, *_NO_ATTR):
                out.missing += 1     # (not there, or not a regular file)
                continue
            raise PffsError(f"{path}: {e.strerror}") from None
        if d != out.pages[ix]:
            out.differ += 1
            out.pages[ix] = d
    return out


def read_sessions(top: Path, mount_root: Path) -> Iterator[SessionPages]:
    """Every session at or below *top*, by path (the live ``engines/`` view left out)."""
    found = sorted(s.path for s in find_sessions(top, mount_root))
    for path in found:
        name = path.name if path == top else str(path.relative_to(top))
        s = read_session(path, name)
        if s is not None:
            yield s
