"""Level t4, engines: the vLLM connector through vLLM's real Scheduler, block
pool and KV views, saving into a real pffs mount.

Every save a request asks for ends ``saved`` or ``failed`` with its reason,
never unknown, and never writes outside the mount: a name that breaks a rule
is refused when the request arrives, naming the rule; a mount unmounted, or
whose daemon is killed, under a scheduled save gives a failure ``pffs wait``
reads after it (kept outside the mount).  A load that fails is computed
instead under vLLM's default policy, and the response says so.
"""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
from mountutil import pffs
from vllm_helpers import Engine

PROMPT = [(i * 37 + 11) % 1000 for i in range(40)]


@pytest.fixture(autouse=True)
def state_dir(tmp_path, monkeypatch):
    d = tmp_path / "state"
    monkeypatch.setenv("PFFS_STATE_DIR", str(d))
    return d


def finish(eng: Engine, name: str) -> str:
    """A request asking to save as *name*, stepped until it finished (its save scheduled or refused)."""
    rid = eng.add(PROMPT, {"pffs_save": name}, max_tokens=2)
    while rid not in eng.outputs:
        eng.step()
    return rid


@contextlib.contextmanager
def save_lane_held(eng: Engine):
    """The worker's save lane busy until the block ends: a save scheduled
    meanwhile starts only then (the harness's scheduler hands saves to its
    in-process worker at once)."""
    go = threading.Event()
    save = eng.worker._save

    def held(job):
        go.wait(60)
        save(job)
    eng.worker._save = held
    try:
        yield
    finally:
        go.set()
        eng.worker._save = save


def wait_code(path, timeout: float = 60) -> tuple[int, str]:
    r = pffs("wait", path, "--timeout", timeout, check=False)
    return r.returncode, r.stderr


def test_names_that_break_a_rule_are_refused_naming_it(tmp_path, mount_factory):
    mnt = mount_factory()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, mnt / "lnk")
    eng = Engine(tmp_path, mnt.path)
    rid = finish(eng, "agent-a")
    eng.run(rid)
    (mnt / "plain").write_text("x")
    free0 = eng.free
    for name, rule in (("x" * 238, "its last part has 238 bytes, over 237"),
                       ("y" * 255, "over 237"),
                       ("a\0b", "NUL byte"),
                       (".pffs/x", "a '.pffs' part"),
                       ("lnk/x", "'lnk' is a symbolic link"),
                       ("q.save-failed", "ends in '.save-failed'"),
                       ("agent-a/pages/x", "agent-a is a session"),
                       ("agent-a/x", "agent-a is a session"),
                       ("plain/x", "'plain' is not a folder"),
                       ("a/./b", "an empty, '.' or '..' part"),
                       ("/abs", "not a session name")):
        rid = finish(eng, name)
        out = eng.run(rid)
        assert rule in out.get("pffs_error", ""), (name, out)
        assert "pffs_save_scheduled" not in out, (name, out)
        assert eng.free == free0, name
    assert os.listdir(elsewhere) == []
    assert sorted(os.listdir(mnt.path)) == ["agent-a", "lnk", "plain"]

    # The longest name saves, and a failed save of it records why beside it.
    longest = "z" * 237
    eng.run(finish(eng, longest))
    assert wait_code(mnt / longest) == (0, "")
    rid = finish(eng, longest)
    assert "exists" in eng.run(rid)["pffs_error"]


def test_a_link_put_on_the_way_after_scheduling_fails_the_save_inside(tmp_path, mount_factory):
    """The worker checks the name again: a folder replaced by a link to
    elsewhere between the request's end and the page-out fails the save,
    nothing is written there, and ``pffs wait`` says why."""
    mnt = mount_factory()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (mnt / "team").mkdir()
    eng = Engine(tmp_path, mnt.path)
    with save_lane_held(eng):
        rid = finish(eng, "team/x")
        assert eng.outputs[rid]["pffs_save_scheduled"] == 41
        os.rename(mnt / "team", mnt / "team-old")
        os.symlink(elsewhere, mnt / "team")
    eng.run(rid)
    code, why = wait_code(mnt / "team" / "x")
    assert code == 1 and "'team' is a symbolic link" in why, why
    assert os.listdir(elsewhere) == [] and os.listdir(mnt / "team-old") == []


def test_an_unmounted_root_fails_its_scheduled_save_and_refuses_the_next(tmp_path, mount_factory,
                                                                         state_dir):
    mnt = mount_factory()
    eng = Engine(tmp_path, mnt.path)
    with save_lane_held(eng):
        rid = finish(eng, "gone")
        assert eng.outputs[rid]["pffs_save_scheduled"] == 41
        assert mnt.stop() == 0
    eng.run(rid)
    assert os.listdir(mnt.path) == [], "the save wrote into the bare mount point"
    code, why = wait_code(mnt / "gone", timeout=5)
    assert code == 1 and "is no longer in a pffs mount" in why, why
    rid = finish(eng, "after")
    assert "is no longer in a pffs mount" in eng.run(rid)["pffs_error"]
    assert os.listdir(mnt.path) == []
    mnt.start()     # (the mount point is empty: the next mount works)
    assert wait_code(mnt / "gone", timeout=5)[0] == 1
    # The same name saved again: the kept record goes, the save ends saved.
    eng.run(finish(eng, "gone"))
    assert wait_code(mnt / "gone") == (0, "")
    assert os.listdir(state_dir / "save-failed") == []


def test_a_save_in_flight_when_the_daemon_is_killed_ends_failed(tmp_path, mount_factory, monkeypatch):
    from engine_bridge.transport import direct
    mnt = mount_factory()
    eng = Engine(tmp_path, mnt.path)
    killed: list[int] = []
    lock = threading.Lock()
    write_page = direct.DirectSink.write_page

    def kill_at_first_page(self, ix, data):
        with lock:      # (pages are written on several threads)
            if not killed:
                mnt.kill9()
                killed.append(ix)
        return write_page(self, ix, data)
    monkeypatch.setattr(direct.DirectSink, "write_page", kill_at_first_page)
    rid = finish(eng, "inflight")
    assert eng.outputs[rid]["pffs_save_scheduled"] == 41
    eng.run(rid)
    assert killed, "the save did not go the direct path"
    mnt.start()
    code, why = wait_code(mnt / "inflight", timeout=5)
    assert code == 1 and "pffs_save 'inflight'" in why, why
    assert not (mnt / "inflight").exists()


def test_a_failed_load_is_computed_under_vllms_default_policy(tmp_path):
    """vLLM's ``kv_load_failure_policy`` defaults to "fail" (the request ends with
    an error and no pffs_error); the connector sets it to recompute unless its
    ``load_failure`` says "fail"."""
    eng = Engine(tmp_path, tmp_path)
    rid = finish(eng, "s")
    eng.run(rid)
    page = tmp_path / "s" / "pages" / "000001"
    data = bytearray(page.read_bytes())
    data[100] ^= 1
    page.write_bytes(bytes(data))
    eng = Engine(tmp_path, tmp_path, policy="fail")
    assert eng.sched.recompute_kv_load_failures
    prompt = PROMPT + [7, 1, 2]
    rid = eng.add(prompt, {"pffs_load": "s"}, max_tokens=2)
    out = eng.run(rid)
    assert "2 page(s) failed to load and were computed instead" in out.get("pffs_error", ""), out
    assert eng.computed[rid][0] == 0
    strict = Engine(tmp_path, tmp_path, extra={"load_failure": "fail"})
    assert not strict.sched.recompute_kv_load_failures
