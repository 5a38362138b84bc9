"""Shared fixtures: real KV data, store directories."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from pffs_testdata import kv_file

REPO = Path(__file__).resolve().parent.parent
# tests/data's trimmed copy of the MiniLM KV, or $PFFS_TEST_DATA's (pffs_testdata).
KV_FILE = kv_file()


def kv_pages(dtype: str = "bf16", page_tokens: int = 16, path: Path = KV_FILE) -> list[bytes]:
    """Real KV pages cut from the MiniLM tensors in *path* as contract §1 lays them out."""
    import numpy as np
    from pffs_testdata import load_raw
    name = {"bf16": "bf16", "f16": "fp16", "fp16": "fp16"}[dtype]
    k, v = load_raw(path, f"k_{name}"), load_raw(path, f"v_{name}")
    pages = []
    for s in range(0, k.shape[1], page_tokens):
        pages.append(np.ascontiguousarray(k[:, s:s + page_tokens]).tobytes()
                     + np.ascontiguousarray(v[:, s:s + page_tokens]).tobytes())
    return pages


@pytest.fixture(scope="session")
def bf16_pages() -> list[bytes]:
    if not KV_FILE.exists():
        pytest.fail(f"test data missing: {KV_FILE}")
    return kv_pages("bf16")


@pytest.fixture(scope="session")
def fp16_pages() -> list[bytes]:
    if not KV_FILE.exists():
        pytest.fail(f"test data missing: {KV_FILE}")
    return kv_pages("fp16")


@pytest.fixture
def mount_factory(tmp_path):
    """Start real mounts; each is unmounted, its exit status, log and store checked."""
    from mountutil import Mount
    mounts: list[Mount] = []

    open_roots: list[Path] = []

    def make(name: str = "m", store=None, opts=(), start=True, root=None) -> Mount:
        root = root or tmp_path / name
        root.mkdir(exist_ok=True)
        m = Mount(root, store, opts)
        mounts.append(m)
        return m.start() if start else m

    def open_root(prefix: str) -> Path:
        """A folder other users can search, for a mount's root (tmp_path's
        parents are private): removed once its mounts are gone."""
        top = Path(tempfile.mkdtemp(prefix=prefix))
        os.chmod(top, 0o755)
        open_roots.append(top)
        return top
    make.open_root = open_root  # type: ignore[attr-defined]

    yield make
    from mountutil import stop_all
    failures = stop_all(mounts)
    for top in open_roots:
        shutil.rmtree(top)      # (raises if a mount kept something in it)
    for m in {str(x.store): x for x in mounts}.values():
        if (m.store / "namespace.db").exists() and not getattr(m, "skip_check", False):
            r = m.check_store()
            if r.returncode != 0:
                failures.append(f"pffs check of {m.store} failed:\n{r.stdout}\n{r.stderr}")
    if failures:
        pytest.fail("\n".join(failures))


@pytest.fixture
def mnt(mount_factory):
    return mount_factory()
