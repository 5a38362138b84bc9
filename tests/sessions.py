"""Build session folders (manifest.json + pages/) from real KV pages, for tests."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from pffs import manifest as mf

GEOMETRY = dict(page_size_tokens=16, n_layers=6, n_heads=12, head_dim=32, dtype="bf16")


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def make_manifest(pages: list[bytes], seq_id: str = "req-1", fill: int = 0, **extra) -> mf.Manifest:
    n = len(pages)
    tokens = (n - 1) * 16 + (fill or 16) if n else 0
    return mf.Manifest(pages=[digest(p) for p in pages],
                       logical_seqs=[mf.LogicalSeq(seq_id, list(range(n)), fill, list(range(tokens)))],
                       model={"name": "all-MiniLM-L6-v2", "revision": "test"},
                       kv={"k_has_rope": False, "scales": None},
                       engine={"name": "test", "kv_layout": "flash_attn NHD", "block_size": 16},
                       **{**GEOMETRY, **extra})


def write_session(path: Path, pages: list[bytes], **kw) -> mf.Manifest:
    """Write a session folder the way a user's tools would (pages first, manifest last)."""
    path = Path(path)
    (path / "pages").mkdir(parents=True)
    for i, p in enumerate(pages):
        (path / "pages" / mf.page_name(i)).write_bytes(p)
    m = make_manifest(pages, **kw)
    (path / "manifest.json").write_bytes(m.to_json())
    return m


def varied_pages(base: list[bytes], n: int, salt: int = 0) -> list[bytes]:
    """*n* distinct pages made from real ones (a counter stamped in the first bytes)."""
    out = []
    for i in range(n):
        p = bytearray(base[i % len(base)])
        p[0:8] = (i + salt * 1_000_003).to_bytes(8, "little")
        out.append(bytes(p))
    return out


def tree_digest(root: Path) -> dict[str, str]:
    """Relative path → sha256 (files) or 'dir' / 'link:target', for comparing trees."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:
            p = Path(dirpath, d)
            out[os.path.normpath(os.path.join(rel, d))] = "link:" + os.readlink(p) if p.is_symlink() else "dir"
        for f in filenames:
            p = Path(dirpath, f)
            key = os.path.normpath(os.path.join(rel, f))
            st = os.lstat(p)
            if p.is_symlink():
                out[key] = "link:" + os.readlink(p)
            elif not stat.S_ISREG(st.st_mode):
                out[key] = f"special:{stat.S_IFMT(st.st_mode):o}:{st.st_rdev}"
            else:
                out[key] = digest(p.read_bytes())
    return out
