"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
Sessions written straight into an unmounted store appear whole in the next mount."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from mountutil import pffs
from pffs import manifest as mf
from pffs.errors import PffsError
from pffs.client.offline import StoreSessionSink, StoreSessionSource
from sessions import digest, make_manifest, varied_pages, write_session


def test_sink_then_mount(tmp_path, bf16_pages, mount_factory):
    store = tmp_path / "store"
    pages = varied_pages(bf16_pages, 5)
    sink = StoreSessionSink(store, "team/a")
    for i, p in enumerate(pages):
        assert sink.write_page(i, memoryview(p)) == digest(p)
    m = make_manifest(pages)
    sink.write_manifest(m.to_json())
    sink.commit()
    src = StoreSessionSource(store, "team/a")
    assert src.read_manifest() == m.to_json()
    assert src.read_page(3) == pages[3] and src.page_digest(3) == digest(pages[3])
    src.close()
    again = StoreSessionSink(store, "team/a")
    for i, p in enumerate(pages):
        again.write_page(i, p)
    again.write_manifest(m.to_json())
    with pytest.raises(FileExistsError):
        again.commit()
    assert pffs("check", "--store", store).returncode == 0
    mnt = mount_factory(store=store)
    assert sorted(os.listdir(mnt / "team" / "a" / "pages")) == [mf.page_name(i) for i in range(5)]
    assert (mnt / "team" / "a" / "pages" / "000004").read_bytes() == pages[4]
    assert json.loads((mnt / ".pffs" / "stats.json").read_text())["sessions"] == 1
    # While mounted, the store is refused (write through the mount instead).
    busy = StoreSessionSink(store, "b")
    busy.write_page(0, pages[0])
    busy.write_manifest(make_manifest(pages[:1]).to_json())
    with pytest.raises(PffsError, match="in use"):
        busy.commit()


def test_sink_refuses_missing_pages(tmp_path, bf16_pages):
    pages = varied_pages(bf16_pages, 3)
    sink = StoreSessionSink(tmp_path / "s", "x")
    sink.write_page(0, pages[0])
    sink.write_manifest(make_manifest(pages).to_json())
    with pytest.raises(PffsError, match="000001"):
        sink.commit()


def test_source_reads_a_fork_a_mount_made(tmp_path, bf16_pages, mount_factory):
    """A fork nothing has looked into yet (one row in the namespace) reads whole offline."""
    store = tmp_path / "store"
    pages = varied_pages(bf16_pages, 3, salt=21)
    write_session(tmp_path / "a", pages)
    mnt = mount_factory(store=store)
    subprocess.run(["cp", "-r", str(tmp_path / "a"), str(mnt / "a")], check=True)
    pffs("fork", mnt / "a", mnt / "b")
    assert mnt.stop() == 0
    src = StoreSessionSource(store, "b")
    assert [src.read_page(i) for i in range(3)] == pages
    assert src.page_digest(2) == digest(pages[2])
    src.close()
