"""Level t3, mounts: the token-chain index shared through the bucket (SPEC §7,
docs/s3.md "One index for every host"), on a real SeaweedFS server with two
mounts of one bucket, each with its own cache folder, as on two hosts.

A session written on mount A is found by its tokens alone on mount B
(``longest_prefix``, ``pffs prefix``, ``pffs from-tokens``), B adopts what it
found (its own index holds it afterwards, no page bytes moved), pages kept by
key alone on A are found on B too; a published entry whose blob is gone is a
miss and is removed; two mounts publishing one key agree on the first; with
the server stopped a lookup misses (never an error) and further lookups do
not ask the silent bucket again for a while.
"""

from __future__ import annotations

import json

from mountutil import pffs
from seaweed import s3_mounts, weed  # noqa: F401  (fixtures)
from sessions import GEOMETRY, digest, varied_pages
from t3_prefix_index import write_session

from pffs.bucket import shared_index
from pffs.client import chainkeys as ck
from pffs.client.prefix_lookup import PrefixIndex, cache_blobs, longest_prefix

T = GEOMETRY["page_size_tokens"]


def index_objects(weed, bucket: str, prefix: str) -> dict[str, str]:
    """The shared index's entries in the bucket: {"<space>/<key>": digest}."""
    c = weed.client
    out = {}
    for key in weed.objects(bucket, f"{prefix}/index/"):
        try:
            body = c.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
        except c.exceptions.NoSuchKey:
            continue        # (removed since it was listed)
        out[key.split("/index/", 1)[1]] = body
    return out


def published(m) -> None:
    """Wait until the mount's publishing threads are idle: its .pffs/stats.json says
    nothing is pending (stats are the daemon's own count)."""
    from mountutil import wait_for
    wait_for(lambda: json.loads((m.path / ".pffs" / "stats.json").read_bytes())
             .get("shared_index", {}).get("pending", 1) == 0, what="publishing")


def test_a_session_on_one_mount_is_found_by_tokens_on_another(weed, s3_mounts, bf16_pages, tmp_path):
    bucket = weed.make_bucket()
    url = f"s3://{bucket}/kv"
    a, b = s3_mounts("a", url), s3_mounts("b", url)
    pages = varied_pages(bf16_pages, 5, salt=303)
    tokens = list(range(80_000, 80_000 + 5 * T))
    man, space, keys = write_session(a.path / "chat", pages, tokens)
    published(a)
    entries = index_objects(weed, bucket, "kv")
    assert entries == {f"{space}/{k}": d for k, d in zip(keys, man.pages)}

    # B has never seen the session: its own index is empty, the bucket's has it.
    with PrefixIndex(b.path, shared=False) as local:
        assert local.longest_prefix(space, keys) == []
    before = shared_index.lookups().requests
    longer = keys[:3] + ck.chain_keys(tokens[:3 * T] + [7] * T, T)[3:]
    assert longest_prefix(b.path, space, longer) == man.pages[:3]
    # (the run published from the first key, then a GET of each key it did not cover)
    assert shared_index.lookups().requests - before == 3
    # Adopted (beside the answer): B's own index holds the pages, by key alone, no bytes moved.
    from mountutil import wait_for

    def local_run() -> list:
        with PrefixIndex(b.path, shared=False) as local:
            return local.longest_prefix(space, keys)
    wait_for(lambda: local_run() == man.pages[:3], what="B to adopt the pages")
    assert longest_prefix(b.path, space, keys) == man.pages

    # pffs from-tokens on B makes a session of A's pages; pffs prefix says where they came from.
    (tmp_path / "tokens.json").write_text(json.dumps(tokens))
    (b.path / "t").mkdir()
    (b.path / "t" / "manifest.json").write_bytes(man.to_json())    # (the model and geometry)
    r = pffs("prefix", b.path / "t", "--json")
    assert json.loads(r.stdout)["found"] == 5
    r = pffs("from-tokens", b.path / "copy", "--like", b.path / "t", "--tokens", tmp_path / "tokens.json",
             check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [digest((b.path / "copy" / "pages" / mf_name(i)).read_bytes()) for i in range(5)] == man.pages


def test_a_chain_is_found_in_one_request_by_its_run(weed, s3_mounts, bf16_pages):
    """A manifest's keys are also published as one run object from its first key:
    a mount that never saw them finds the whole chain in one GET; a lookup
    starting where no run starts asks for each key; a run naming a blob gone
    is a miss and is removed with the entry."""
    bucket = weed.make_bucket()
    url = f"s3://{bucket}/kv"
    a, b, c = s3_mounts("a", url), s3_mounts("b", url), s3_mounts("c", url)
    pages = varied_pages(bf16_pages, 6, salt=606)
    man, space, keys = write_session(a.path / "chat", pages, list(range(90_000, 90_000 + 6 * T)))
    published(a)
    runs = {k: weed.client.get_object(Bucket=bucket, Key=k)["Body"].read().decode()
            for k in weed.objects(bucket, "kv/runs/")}
    assert runs == {f"kv/runs/{space}/{keys[0]}": "".join(f"{k} {d}\n" for k, d in zip(keys, man.pages))}
    assert json.loads((a.path / ".pffs" / "stats.json").read_bytes())["shared_index"]["runs"] == 1

    before = shared_index.lookups().requests
    assert longest_prefix(b.path, space, keys) == man.pages
    assert shared_index.lookups().requests - before == 1
    before = shared_index.lookups().requests
    assert longest_prefix(c.path, space, keys[2:]) == man.pages[2:]
    assert shared_index.lookups().requests - before == 1 + 4     # (no run from there: a GET a key)

    # A run whose first entry's blob is gone: a miss once adoption checks it; entry and run removed.
    ghosts = ck.chain_keys(list(range(7, 7 + 3 * T)), T)
    bogus = ["sha256:" + f"{i:02x}" * 32 for i in (1, 2, 3)]
    for k, d in zip(ghosts, bogus):
        weed.client.put_object(Bucket=bucket, Key=f"kv/index/{space}/{k}", Body=d.encode())
    weed.client.put_object(Bucket=bucket, Key=f"kv/runs/{space}/{ghosts[0]}",
                           Body="".join(f"{k} {d}\n" for k, d in zip(ghosts, bogus)).encode())
    b.allow(r"user.pffs.prefix.put: refused: \d of the \d blobs named are not in the store")
    assert longest_prefix(b.path, space, ghosts) in ([], bogus)
    from mountutil import wait_for
    wait_for(lambda: f"kv/runs/{space}/{ghosts[0]}" not in weed.objects(bucket, "kv/runs/")
             and f"{space}/{ghosts[0]}" not in index_objects(weed, bucket, "kv"), what="the run removed")
    shared_index.lookups().missing.clear()      # (misses remembered meanwhile, for 2 s)
    assert longest_prefix(b.path, space, ghosts) == []


def mf_name(i: int) -> str:
    from pffs import manifest as mf
    return mf.page_name(i)


def test_key_only_pages_are_shared_and_a_gone_blob_is_a_miss(weed, s3_mounts, bf16_pages):
    bucket = weed.make_bucket()
    url = f"s3://{bucket}/kv"
    a, b = s3_mounts("a", url), s3_mounts("b", url)
    pages = varied_pages(bf16_pages, 2, salt=404)
    man, space, keys = write_session(a.path / "s", pages, list(range(1, 2 * T + 1)))
    # A page kept by key alone on A (as SGLang's write-through keeps them).
    other = ck.chain_keys(list(range(5, 5 + T)), T)
    cache_blobs(a.path, space, [(other[0], man.pages[1])])
    published(a)
    assert longest_prefix(b.path, space, other) == [man.pages[1]]

    # Another entry whose blob the bucket no longer holds: a miss, and removed.
    ghost = ck.chain_keys(list(range(9, 9 + T)), T)[0]
    c = weed.client
    c.put_object(Bucket=bucket, Key=f"kv/index/{space}/{ghost}", Body=b"sha256:" + b"ab" * 32)
    # (B's mount refuses to keep a page whose blob is not there, saying so; the lookup then
    # checks the blobs itself)
    b.allow(r"user.pffs.prefix.put: refused: 1 of the 1 blobs named are not in the store")
    # The lookup answers at once (a read of the page would miss); its adoption checks
    # the blob, finds it gone and removes the entry; then the key is a miss.
    assert longest_prefix(b.path, space, [ghost]) in ([], ["sha256:" + "ab" * 32])
    from mountutil import wait_for
    wait_for(lambda: f"{space}/{ghost}" not in index_objects(weed, bucket, "kv"), what="the entry removed")
    shared_index.lookups().missing.clear()      # (its miss remembered meanwhile, for 2 s)
    assert longest_prefix(b.path, space, [ghost]) == []


def test_two_mounts_publishing_one_key_agree_on_the_first(weed, s3_mounts, bf16_pages):
    bucket = weed.make_bucket()
    url = f"s3://{bucket}/kv"
    a, b = s3_mounts("a", url), s3_mounts("b", url)
    first, second = varied_pages(bf16_pages, 2, salt=505)
    space = "5" * 64
    key = ck.chain_keys(list(range(3, 3 + T)), T)[0]
    (a.path / "x").write_bytes(first)
    (b.path / "y").write_bytes(second)
    from pffs.client.prefix_lookup import cache_page
    cache_page(a.path / "x", space, key)
    published(a)
    cache_page(b.path / "y", space, key)
    published(b)
    assert index_objects(weed, bucket, "kv") == {f"{space}/{key}": digest(first)}


def test_an_unreachable_bucket_makes_lookups_miss_and_is_not_asked_again_at_once(weed, s3_mounts,
                                                                                  bf16_pages):
    bucket = weed.make_bucket()
    url = f"s3://{bucket}/kv"
    a, b = s3_mounts("a", url), s3_mounts("b", url)
    pages = varied_pages(bf16_pages, 2, salt=606)
    man, space, keys = write_session(a.path / "s", pages, list(range(40, 40 + 2 * T)))
    published(a)
    for m in (a, b):
        m.skip_check = True     # (the server is stopped under them)
    weed.stop()
    try:
        with PrefixIndex(b.path) as index:
            assert index.longest_prefix(space, keys) == []        # a miss, no error
            asked = shared_index.lookups().requests
            assert index.longest_prefix(space, keys) == []
            assert shared_index.lookups().requests == asked       # the quiet time: not asked
    finally:
        shared_index.lookups().quiet_until = 0.0
        weed.start()


def test_bucket_gc_keeps_pages_another_mount_adopted_by_tokens(weed, s3_mounts, bf16_pages):
    """Mount B adopts A's pages by their tokens; A's session goes; bucket gc keeps
    them (B's registration lists its key-only cache) and B still reads them by key."""
    import subprocess
    import time

    from mountutil import wait_for
    from t3_s3_mount import blob_objects, registration_of

    from pffs.client.access import open_bucket
    bucket = weed.make_bucket()
    url = f"s3://{bucket}/kv"
    a, b = s3_mounts("a", url, ["lease=4s"]), s3_mounts("b", url, ["lease=4s"])
    pages = varied_pages(bf16_pages, 3, salt=707)
    man, space, keys = write_session(a.path / "s", pages, list(range(60, 60 + 3 * T)))
    published(a)
    assert longest_prefix(b.path, space, keys) == man.pages
    subprocess.run(["rm", "-r", str(a.path / "s")], check=True)
    wait_for(lambda: not registration_of(weed, bucket, "kv", a) & set(man.pages), timeout=20,
             what="A's registration to drop the session")
    wait_for(lambda: set(man.pages) <= registration_of(weed, bucket, "kv", b), timeout=20,
             what="B's registration to list the adopted pages")
    for _ in range(2):      # set aside, then delete once the (zero) grace period passed
        pffs("gc", "--store", url, "--grace", "0")
        time.sleep(1.1)     # (object times have one-second resolution)
    assert set(man.pages) <= set(blob_objects(weed, bucket, "kv"))
    with PrefixIndex(b.path) as index:
        assert index.longest_prefix(space, keys) == man.pages
    info = json.loads((b.path / ".pffs" / "store.json").read_bytes())
    assert [open_bucket(info).get(d) for d in man.pages] == pages
