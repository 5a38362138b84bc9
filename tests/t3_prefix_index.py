"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
Sessions as a prefix cache (SPEC §7): a session's full pages are found by
their token chain keys (pffs.client.prefix_lookup) as soon as its
manifest.json is closed, through cp -r and pffs fork forks (which add no
index row), across a remount, and not after rm -r and gc; pffs check finds
an index that disagrees with the manifests and --repair rebuilds it; pages
kept by key alone (user.pffs.prefix) go least recently used first past
-o prefix_cache_size=, while sessions' pages stay found (docs/prefix-index.md).
"""

from __future__ import annotations

import json
import os
import sqlite3

from lifecycle_helpers import count, gc, rm_r, run
from mountutil import by_timing, pffs, requests_made
from sessions import GEOMETRY, digest, varied_pages

from pffs import manifest as mf
from pffs.client import chainkeys as ck
from pffs.client.prefix_lookup import PrefixIndex, cache_page, longest_prefix
from pffs.store.storedir import StoreDir

T = GEOMETRY["page_size_tokens"]


def write_session(path, pages: list[bytes], tokens: list[int]) -> tuple[mf.Manifest, str, list[str]]:
    """A session whose one sequence holds *tokens*, pages first, manifest last: (its manifest,
    its key namespace, its pages' keys)."""
    os.makedirs(path / "pages")
    for i, p in enumerate(pages):
        (path / "pages" / mf.page_name(i)).write_bytes(p)
    fill = len(tokens) % T
    m = mf.Manifest(pages=[digest(p) for p in pages], model={"name": "all-MiniLM-L6-v2", "revision": "test"},
                    kv={"k_has_rope": False, "scales": None},
                    logical_seqs=[mf.LogicalSeq("req-1", list(range(len(pages))), fill, tokens)], **GEOMETRY)
    (path / "manifest.json").write_bytes(m.to_json())
    return m, ck.manifest_namespace(json.loads(m.to_json())), ck.chain_keys(tokens, T)


KEYED = "SELECT COUNT(*) FROM manifest_pages WHERE key IS NOT NULL"


def test_a_sessions_pages_are_found_by_tokens_through_forks_and_remounts_until_removed(
        mount_factory, bf16_pages):
    m = mount_factory()
    pages = varied_pages(bf16_pages, 6, salt=71)
    tokens = list(range(70_000, 70_000 + 6 * T - 3))         # the last page is short
    man, space, keys = write_session(m.path / "a", pages, tokens)
    assert len(keys) == 5
    assert longest_prefix(m.path, space, keys) == man.pages[:5]     # at once: the close recorded it
    assert count(m, KEYED) == 5
    run("cp", "-r", m.path / "a", m.path / "b")
    pffs("fork", m.path / "a", m.path / "c")
    assert count(m, "SELECT COUNT(*) FROM manifests") == 3
    assert count(m, KEYED) == 5                               # the forks added no row
    longer = ck.chain_keys(tokens[:4 * T] + [1, 2, 3], T) + ["f" * 64]
    assert longest_prefix(m.path, space, longer) == man.pages[:4]
    assert longest_prefix(m.path, "0" * 64, keys) == []         # another namespace
    report = json.loads(pffs("prefix", "--json", m.path / "a").stdout)
    assert report["found"] == 5 and [p["key"] for p in report["pages"]] == keys
    assert report["pages"][0]["holders"] == ["/a", "/b", "/c"]
    text = pffs("prefix", m.path / "b").stdout
    assert "5 full pages of 16 tokens keyed, the store holds the first 5" in text
    assert f"     4  {keys[4][:16]}  /a, /b, /c" in text
    (m.path / "tokens.json").write_text(json.dumps(tokens[:2 * T] + [5] * T))
    asked = json.loads(pffs("prefix", "--json", "--tokens", m.path / "tokens.json", m.path / "c").stdout)
    assert asked["found"] == 2 and len(asked["pages"]) == 3 and asked["pages"][2]["holders"] == []
    assert m.stop() == 0
    m.start()
    assert longest_prefix(m.path, space, keys) == man.pages[:5]
    rm_r(m, m.path / "a", m.path / "b")
    assert longest_prefix(m.path, space, keys) == man.pages[:5]     # c holds them still
    rm_r(m, m.path / "c")
    assert longest_prefix(m.path, space, keys) == [] and count(m, KEYED) == 0
    gc(m.store)
    assert not StoreDir(m.store).blobs.path(man.pages[0]).exists()


def test_check_finds_an_index_that_lost_rows_and_repair_rebuilds_it(mount_factory, bf16_pages):
    m = mount_factory()
    man, space, keys = write_session(m.path / "s", varied_pages(bf16_pages, 4, salt=72),
                                     list(range(80_000, 80_000 + 4 * T)))
    assert m.stop() == 0
    c = sqlite3.connect(m.store / "namespace.db")
    c.execute("UPDATE manifest_pages SET space = NULL, key = NULL")
    c.commit()
    c.close()
    r = pffs("check", "--store", m.store, check=False)
    assert r.returncode == 1 and "DAMAGE: /s/manifest.json: the prefix index holds 0 keys" in r.stdout
    r = pffs("check", "--store", m.store, "--repair")
    assert "rebuilt the prefix index: 4 keys of 1 manifests" in r.stdout
    m.start()
    assert longest_prefix(m.path, space, keys) == man.pages


def test_key_only_pages_go_least_recently_used_first_and_session_pages_stay(mount_factory, bf16_pages):
    size = len(bf16_pages[0])
    m = mount_factory(opts=[f"prefix_cache_size={3 * size}"])
    man, space, skeys = write_session(m.path / "s", varied_pages(bf16_pages, 2, salt=73),
                                      list(range(90_000, 90_000 + 2 * T)))
    cache = m.path / "cache"
    cache.mkdir()
    loose = varied_pages(bf16_pages, 5, salt=74)
    keys = [f"{i + 1:064x}" for i in range(5)]
    index = PrefixIndex(m.path)
    try:
        for i in range(3):
            (cache / f"p{i}").write_bytes(loose[i])
            cache_page(cache / f"p{i}", space, keys[i])
        rm_r(m, cache / "p0", cache / "p1", cache / "p2")
        gc(m.store)                                              # the cache's rows hold their blobs
        assert [index.longest_prefix(space, [k]) for k in keys[:3]] == [[digest(p)] for p in loose[:3]]
        index.longest_prefix(space, [keys[0]])                   # used: now the newest
        for i in (3, 4):
            (cache / f"p{i}").write_bytes(loose[i])
            cache_page(cache / f"p{i}", space, keys[i])
        rm_r(m, cache / "p3", cache / "p4")
        # Three pages fit: keys[1] and keys[2] were the least recently used.
        found = {k: index.longest_prefix(space, [k], touch=False) for k in keys}
        assert found == {keys[0]: [digest(loose[0])], keys[1]: [], keys[2]: [],
                         keys[3]: [digest(loose[3])], keys[4]: [digest(loose[4])]}
        assert index.longest_prefix(space, skeys) == man.pages     # never evicted
    finally:
        index.close()
    gc(m.store)
    blobs = StoreDir(m.store).blobs
    assert [blobs.path(digest(p)).exists() for p in loose] == [True, False, False, True, True]


def test_blobs_put_beside_the_mount_are_kept_by_key_in_one_request(mount_factory, bf16_pages):
    """user.pffs.prefix.put: pages an engine put into the store by the direct path
    (their bytes never cross FUSE) kept by key in one setxattr; gc keeps them; a batch
    naming a blob the store lacks records nothing (ENOENT, one log line); a value that
    is not pairs of hex is refused (EINVAL)."""
    import errno

    import pytest

    from engine_bridge.transport.mountinfo import store_access
    from pffs.client.access import gc_lock
    from pffs.client.prefix_lookup import cache_blobs
    from pffs.errors import PffsError
    from pffs.names import PREFIX_PUT_XATTR

    m = mount_factory()
    m.allow(r"prefix\.put: refused")
    access = store_access(m.path)
    assert access is not None
    pages = varied_pages(bf16_pages, 4, salt=91)
    ds = [digest(p) for p in pages]
    keys = ck.chain_keys(list(range(7_000, 7_000 + 4 * T)), T)
    space = "ab" * 32
    blobs, gcl = access.blobs(), gc_lock(access.root)
    pins = gcl.pin()
    try:
        pins.add(ds)
        hold = gcl.hold_shared()
        for p, d in zip(pages, ds[:3]):
            blobs.put(p, d)
        hold.release()
        made = requests_made(m.path, lambda: cache_blobs(m.path, space, list(zip(keys[:3], ds[:3]))))
        assert by_timing(made)[0] == {"setxattr": 1}, made
        # The fourth page was never put: its batch records nothing.
        with pytest.raises(PffsError, match="No such file"):
            cache_blobs(m.path, space, [(keys[2], ds[2]), (keys[3], ds[3])])
    finally:
        pins.close()
    gc(m.store)
    assert longest_prefix(m.path, space, keys) == ds[:3]
    assert StoreDir(m.store).blobs.get(ds[2]) == pages[2]
    with pytest.raises(OSError) as e:
        os.setxattr(m.path, PREFIX_PUT_XATTR, f"{space} {keys[0]}".encode())
    assert e.value.errno == errno.EINVAL
    assert len({ln for ln in m.log_text().splitlines() if "prefix.put: refused" in ln}) == 2


def test_from_tokens_makes_a_session_of_the_indexed_pages(mount_factory, bf16_pages, tmp_path):
    """pffs from-tokens: a named session of the pages the index holds for a token
    sequence (a prefix of it), in a template's namespace, whose page files appear
    without a page byte read; it forks with cp -r, pffs tokens prints its tokens,
    and pffs check --read-data finds the store clean.  A template of another
    model finds nothing (exit 1, one line)."""
    m = mount_factory()
    tokens = list(range(60_000, 60_000 + 3 * T))
    man, space, keys = write_session(m.path / "a", varied_pages(bf16_pages, 3, salt=81), tokens)
    asked = tokens + list(range(5, 5 + T + 3))           # one more full page no session holds
    (tmp_path / "t.json").write_text(json.dumps(asked))
    r = pffs("from-tokens", m.path / "kept", "--tokens", tmp_path / "t.json", "--like", m.path / "a")
    assert r.stdout.strip() == f"{m.path / 'kept'}: 3 pages ({3 * T} tokens) of the 4 full pages of {len(asked)} tokens"
    kept = mf.parse((m.path / "kept" / "manifest.json").read_bytes())
    assert kept.pages == man.pages and kept.logical_seqs[0].token_ids == tokens
    assert sorted(os.listdir(m.path / "kept" / "pages")) == [mf.page_name(i) for i in range(3)]
    assert (m.path / "kept" / "pages" / mf.page_name(1)).read_bytes() == \
        (m.path / "a" / "pages" / mf.page_name(1)).read_bytes()
    run("cp", "-r", m.path / "kept", m.path / "kept2")
    assert json.loads(pffs("tokens", m.path / "kept2").stdout) == tokens
    other = json.loads((m.path / "a" / "manifest.json").read_bytes())
    other["model"] = {"name": "another-model", "revision": "x"}
    (tmp_path / "other.json").write_text(json.dumps(other))
    r = pffs("from-tokens", m.path / "none", "--tokens", tmp_path / "t.json", "--like",
             tmp_path / "other.json", check=False)
    assert r.returncode == 1 and "holds no page of the first" in r.stderr, r.stderr
    assert not (m.path / "none").exists()
    m.stop()
    r = pffs("check", "--store", m.store, "--read-data", check=False)
    assert r.returncode == 0, r.stdout + r.stderr
