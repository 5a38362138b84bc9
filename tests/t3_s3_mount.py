"""Level t3, mounts: a real FUSE mount (the daemon in a subprocess).
Mounts of one S3 bucket (SeaweedFS): push and pull between mounts, the reference
engine paging out on one mount and in on another, and gc of the shared bucket."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest
import torch

from mountutil import pffs, wait_for
from pffs import manifest as mf
from pffs.bucket.transfer import decode_registration
from seaweed import s3_mounts, weed  # noqa: F401  (fixtures)
from sessions import digest, make_manifest, varied_pages, write_session


def blob_objects(weed, bucket: str, prefix: str, area: str = "blobs/") -> dict[str, int]:
    """digest → object size of every blob (or trash entry) in the bucket under PREFIX."""
    out = {}
    for key, size in weed.objects(bucket, f"{prefix}/{area}").items():
        out["sha256:" + key.rsplit("/", 1)[1]] = size
    return out


def stats(mnt) -> dict:
    return json.loads((mnt / ".pffs" / "stats.json").read_text())


def registration_of(weed, bucket: str, prefix: str, mnt) -> set[str]:
    for key in weed.objects(bucket, f"{prefix}/mounts/"):
        reg = decode_registration(weed.client.get_object(Bucket=bucket, Key=key)["Body"].read())
        if reg["cache"] == str(mnt.store):
            return set(reg["digests"])
    return set()


def read_pages(session, n: int) -> list[bytes]:
    return [(session / "pages" / mf.page_name(i)).read_bytes() for i in range(n)]


# ------------------------------------------------------------- push / pull


def test_push_pull_between_mounts_moves_metadata_only(weed, s3_mounts, bf16_pages):
    bucket = weed.make_bucket()
    url = f"s3://{bucket}/team"
    m1, m2 = s3_mounts("m1", url, ["lease=4s"]), s3_mounts("m2", url, ["lease=4s"])
    pages = varied_pages(bf16_pages, 12)
    m = write_session(m1 / "agent", pages)
    manifest = (m1 / "agent" / "manifest.json").read_bytes()

    uploaded = blob_objects(weed, bucket, "team")
    # Each page and the manifest once, in the local store's frames and names.
    assert set(uploaded) == {digest(p) for p in pages} | {digest(manifest)}
    assert sum(uploaded.values()) == stats(m1)["stored_bytes"]

    r = pffs("push", m1 / "agent", "agent-a")
    assert "agent-a" in r.stdout and "12 pages" in r.stdout
    assert weed.objects(bucket, "team/manifests/") == {"team/manifests/agent-a": len(manifest)}
    listing = pffs("ls-remote", m2.path).stdout
    assert listing.startswith("agent-a\t12 pages")
    assert json.loads(pffs("ls-remote", "--json", "--store", url).stdout)[0]["name"] == "agent-a"
    # A second push under the same name is refused unless forced.
    r = pffs("push", m1 / "agent", "agent-a", check=False)
    assert r.returncode == 1 and "already published" in r.stderr

    r = pffs("pull", "agent-a", m2 / "b", "--store", url)
    assert "12 pages" in r.stdout
    assert sorted(os.listdir(m2 / "b" / "pages")) == [mf.page_name(i) for i in range(12)]
    assert (m2 / "b" / "manifest.json").read_bytes() == manifest
    assert read_pages(m2 / "b", 12) == pages
    assert "looked up 12 pages" in m2.log_text()

    # Pulling, reading and copying on mount 2 uploaded nothing.
    subprocess.run(["cp", "-r", str(m2 / "b"), str(m2 / "c")], check=True)
    assert read_pages(m2 / "c", 12) == pages
    assert blob_objects(weed, bucket, "team") == uploaded
    assert stats(m2)["sessions"] == 2 and stats(m2)["unique_blobs"] == 13

    # Both mounts are registered, each listing what its namespace references (within a lease check).
    assert len(weed.objects(bucket, "team/mounts/")) == 2
    wait_for(lambda: registration_of(weed, bucket, "team", m1) == set(uploaded), timeout=20,
             what="m1's registration")
    wait_for(lambda: registration_of(weed, bucket, "team", m2) == set(uploaded), timeout=20,
             what="m2's registration")

    # Errors are one line and a non-zero exit.
    r = pffs("pull", "no-such", m2 / "x", check=False)
    assert r.returncode == 1 and "no session 'no-such'" in r.stderr and not (m2 / "x").exists()
    r = pffs("pull", "agent-a", m2 / "b", check=False)
    assert r.returncode == 1 and "already exists" in r.stderr
    r = pffs("pull", "agent-a", m2 / "y", "--store", f"s3://{bucket}/elsewhere", check=False)
    assert r.returncode == 1 and f"in a mount of {url}, not of s3://{bucket}/elsewhere" in r.stderr


def test_push_refuses_pages_missing_from_the_bucket(weed, s3_mounts, bf16_pages):
    bucket = weed.make_bucket()
    m1 = s3_mounts("m1", f"s3://{bucket}/p")
    pages = varied_pages(bf16_pages, 3)
    write_session(m1 / "s", pages[:2])
    # A manifest that lists a page nobody wrote: the session is incomplete.
    (m1 / "t").mkdir()
    (m1 / "t" / "manifest.json").write_bytes(make_manifest(pages).to_json())
    r = pffs("push", m1 / "t", check=False)
    assert r.returncode == 1 and "page 000002" in r.stderr and "nothing published" in r.stderr
    assert weed.objects(bucket, "p/manifests/") == {}


def test_large_file_in_blocks_reads_back_from_the_bucket(weed, s3_mounts):
    from pffs.namespace import BLOCK_SIZE
    bucket = weed.make_bucket()
    m = s3_mounts("m", f"s3://{bucket}/big")
    data = os.urandom(BLOCK_SIZE + (3 << 20))
    (m / "big.bin").write_bytes(data)
    blocks = [digest(data[:BLOCK_SIZE]), digest(data[BLOCK_SIZE:])]
    assert set(blob_objects(weed, bucket, "big")) == set(blocks)
    assert os.getxattr(m / "big.bin", "user.pffs.digest").decode() == digest(data)
    # From the bucket alone: no frames cached, a fresh daemon.
    assert m.stop() == 0
    shutil.rmtree(m.store / "blobs")
    m.start()
    assert (m / "big.bin").read_bytes() == data


# S3_FSX_SEEDS="1 2 3 ..." and S3_FSX_OPS=N run longer searches.
S3_FSX_SEEDS = [int(s) for s in os.environ.get("S3_FSX_SEEDS", "5").split()]


@pytest.mark.parametrize("seed", S3_FSX_SEEDS)
def test_random_operations_read_back_from_the_bucket_alone(weed, s3_mounts, seed):
    """The model-checked random operations of t3_mount_fsx on an S3 store;
    then, with the local blob cache deleted, every file again from the bucket."""
    from t3_mount_fsx import Fsx, check_tree
    bucket = weed.make_bucket()
    m = s3_mounts("m", f"s3://{bucket}/fsx")
    model = Fsx(m.path, seed).run(int(os.environ.get("S3_FSX_OPS", "300")))
    check_tree(m.path, model)
    assert m.stop() == 0
    shutil.rmtree(m.store / "blobs")
    m.start()
    check_tree(m.path, model)


# ------------------------------------------------------------- the engine


SEED = 7
PROMPTS = {"x": [(37 * i + 11) % 512 for i in range(53)], "y": [(101 * i + 3) % 512 for i in range(29)]}
IDS = list(PROMPTS)


def test_engine_pages_out_on_one_mount_and_in_on_another(weed, s3_mounts):
    from engine_bridge.reference.reference_engine import ReferenceEngine
    bucket = weed.make_bucket()
    url = f"s3://{bucket}/kv"
    m1, m2 = s3_mounts("m1", url), s3_mounts("m2", url)
    a = ReferenceEngine(dtype="bf16", seed=SEED)
    for sid, p in PROMPTS.items():
        a.add_request(sid, p)
    last = None
    for _ in range(20):
        last = a.step(IDS)
    m = a.page_out(m1 / "chat")
    pffs("push", m1 / "chat")
    pffs("pull", "chat", m2 / "restored")
    want_t, want_l = a.generate(IDS, 12)

    b = ReferenceEngine(dtype="bf16", seed=SEED)
    assert sorted(b.page_in(m2 / "restored")) == sorted(IDS)
    # The saved KV ends before the newest token: the first step replays a's last one.
    replay = b.step(IDS)
    for sid in IDS:
        assert replay[sid].token == last[sid].token
        assert torch.equal(replay[sid].logits, last[sid].logits)
    got_t, got_l = b.generate(IDS, 12)
    assert got_t == want_t
    for sid in IDS:
        assert all(torch.equal(x, y) for x, y in zip(got_l[sid], want_l[sid])), sid
    # Page bytes crossed over through the bucket only once.
    assert set(blob_objects(weed, bucket, "kv")) >= set(m.pages)
    assert len(blob_objects(weed, bucket, "kv")) == len(set(m.pages)) + 1


# ------------------------------------------------------------- gc


def test_gc_keeps_what_published_manifests_and_live_mounts_reference(weed, s3_mounts, bf16_pages):
    bucket = weed.make_bucket()
    url = f"s3://{bucket}/g"
    opts = ["lease=4s"]
    m1, m2 = s3_mounts("m1", url, opts), s3_mounts("m2", url, opts)
    pa, pb, pc, pd, pe = (varied_pages(bf16_pages, 4, salt=s) for s in range(1, 6))
    write_session(m1 / "a", pa)      # pushed, pulled by m2, then withdrawn and deleted on m1
    write_session(m1 / "b", pb)      # only in m1's namespace
    mc = write_session(m1 / "c", pc)  # deleted: garbage
    write_session(m2 / "d", pd)      # only in m2's namespace
    me = write_session(m2 / "e", pe)  # published, then deleted on m2: only the manifest keeps it
    pffs("push", m1 / "a")
    pffs("push", m2 / "e")
    pffs("pull", "a", m2 / "a")
    pffs("rm-remote", "a", "--store", url)
    subprocess.run(["rm", "-r", str(m1 / "a"), str(m1 / "c"), str(m2 / "e")], check=True)
    garbage = {digest(p) for p in pc}
    # Each mount's registration follows its namespace within a lease check.
    wait_for(lambda: not registration_of(weed, bucket, "g", m1) & ({digest(p) for p in pa} | garbage),
             timeout=20, what="m1's registration to drop a and c")
    wait_for(lambda: {digest(p) for p in pa} <= registration_of(weed, bucket, "g", m2),
             timeout=20, what="m2's registration to list a's pages")

    dry = pffs("gc", "--store", url, "--grace", "0", "--dry-run").stdout
    assert "would set aside" in dry
    before = blob_objects(weed, bucket, "g")
    assert garbage <= set(before)
    for _ in range(2):  # set aside, then delete once the (zero) grace period has passed
        r = pffs("gc", "--store", url, "--grace", "0")
        time.sleep(1.1)  # object times have one-second resolution
    assert "2 registered stores" in r.stdout
    after = blob_objects(weed, bucket, "g")
    assert not garbage & set(after)
    assert not blob_objects(weed, bucket, "g", "trash/")
    for pages in (pa, pb, pd, pe):
        assert {digest(p) for p in pages} <= set(after)
    # Gone: c's pages, and the manifest files of c and e (e's published copy is not a blob).
    assert set(before) - set(after) == garbage | {digest(mc.to_json()), digest(me.to_json())}

    # Everything still referenced reads back, also through the bucket (fresh pulls).
    assert read_pages(m1 / "b", 4) == pb and read_pages(m2 / "d", 4) == pd
    assert read_pages(m2 / "a", 4) == pa
    pffs("pull", "e", m1 / "e")
    assert read_pages(m1 / "e", 4) == pe
    # m1 still has index rows of c's collected pages: a manifest listing them brings none back.
    (m1 / "c2" / "pages").mkdir(parents=True)
    (m1 / "c2" / "manifest.json").write_bytes(mc.to_json())
    assert os.listdir(m1 / "c2" / "pages") == []
    assert "4 pages listed by a manifest are no longer in" in m1.log_text()
