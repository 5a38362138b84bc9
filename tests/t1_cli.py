"""Level t1, units: no mount and no engine.
The command line's parser: each command built alone parses as with every command built."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pffs import cli
from pffs.client.fork import _json_str

SAMPLES = [
    ["mount", "-f", "--store", "/s", "-o", "cache_size=1M", "-o", "allow_other", "/m"],
    ["umount", "/m"],
    ["fork", "a", "b"],
    ["seal", "s"],
    ["wait", "s", "--timeout", "1.5"],
    ["from-tokens", "/m/n", "--tokens", "t.json", "--like", "/m/a"],
    ["tokens", "/m/a", "--seq", "r1"],
    ["demo", "--dtype", "f32", "--tokens", "3"],
    ["stats", "--json", "/m"],
    ["du", "--json", "/m/a", "/m/b"],
    ["check", "--read-data", "--repair", "--store", "/s"],
    ["gc", "--dry-run", "--grace", "0"],
    ["prune", "/p", "--keep-last", "2"],
    ["tree", "/p", "--svg", "t.svg", "--lines", "10"],
    ["prefix", "/m/s", "--tokens", "t.json", "--json"],
    ["push", "s", "n", "--force"],
    ["pull", "n", "/d"],
    ["ls-remote", "--json"],
    ["rm-remote", "n", "/p"],
]


def test_every_command_has_a_sample():
    assert sorted(a[0] for a in SAMPLES) == sorted(name for name, _, _ in cli.COMMANDS)


@pytest.mark.parametrize("argv", SAMPLES, ids=[a[0] for a in SAMPLES])
def test_a_command_parses_alike_built_alone_or_with_all(argv):
    alone = cli.build_parser(argv)
    every = cli.build_parser(None)
    assert list(alone._subparsers._group_actions[0].choices) == [argv[0]]
    assert len(every._subparsers._group_actions[0].choices) == len(cli.COMMANDS)
    a, b = vars(alone.parse_args(argv)), vars(every.parse_args(argv))
    assert callable(a.pop("func")) and callable(b.pop("func"))
    assert a == b and a["cmd"] == argv[0]


def run(*args):
    return subprocess.run([sys.executable, "-m", "pffs.cli", *args], capture_output=True, text=True,
                          timeout=60)


def test_help_lists_every_command_and_a_typo_names_them_all():
    r = run("--help")
    assert r.returncode == 0
    for name, help, _ in cli.COMMANDS:
        assert name in r.stdout and help.split()[0] in r.stdout
    r = run("frok", "a", "b")
    assert r.returncode == 2
    assert "invalid choice: 'frok'" in r.stderr and "'rm-remote'" in r.stderr
    r = run("fork", "a")
    assert r.returncode == 2 and "pffs fork" in r.stderr and "dst" in r.stderr


def test_fork_takes_the_arguments_argparse_gives_it():
    fast = cli._ForkArgs("a", "b")
    parsed = cli.build_parser(["fork", "a", "b"]).parse_args(["fork", "a", "b"])
    assert (fast.cmd, fast.src, fast.dst, fast.func) == (parsed.cmd, parsed.src, parsed.dst, parsed.func)


# What a quick fork would otherwise import (each a fifth of Python's start-up).
HEAVY = ("argparse", "re", "typing", "json", "pathlib", "shutil", "hashlib", "sqlite3")


def test_fork_imports_nothing_heavy(tmp_path):
    probe = ("import sys; before = set(sys.modules); from pffs import cli; "
             "rc = cli.main(['fork', sys.argv[1], sys.argv[2]]); "
             "print(rc, ' '.join(sorted(set(sys.modules) - before)))")
    r = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "nosuch"), str(tmp_path / "b")],
                       capture_output=True, text=True, timeout=60)
    rc, _, loaded = r.stdout.strip().partition(" ")
    assert rc == "1" and "not a session (no manifest.json)" in r.stderr
    assert not set(loaded.split()) & set(HEAVY), loaded


@pytest.mark.parametrize("s", ["plain", 'a "quoted" \\ name', "tab\there\n", "päge-ü €",
                               "bytes\udcff\udc80 not utf-8", ""])
def test_a_load_request_names_any_path_as_json_does(s):
    assert json.loads(_json_str(s)) == s
    assert json.loads('{"session": %s}' % _json_str(s).encode().decode()) == {"session": s}


def test_the_options_of_mount8_and_fstab_are_taken():
    """What mount(8), fstab, systemd and habit give with -o: the kernel's flags kept
    for the kernel's mount, ro and rw, sync and async (as sync=close and batch),
    the rest taken as saying nothing to pffs; an unknown option named."""
    from pffs.daemon.mount import parse_options
    from pffs.errors import PffsError
    o = parse_options(["rw,nosuid,nodev,noatime,allow_other,default_permissions,relatime,nofail,_netdev",
                       "x-systemd.automount,comment=pffs,auto,noauto,user,users,defaults,sync"])
    assert o.allow_other and not o.read_only and o.sync == "close"
    assert o.kernel_flags == ["nosuid", "nodev", "noatime"]
    o = parse_options(["ro,dev,suid,exec,async"])
    assert o.read_only and o.kernel_flags == ["dev", "suid", "exec"] and o.sync == "batch"
    assert not parse_options(["ro", "rw"]).read_only
    assert parse_options(["sync=close"]).sync == "close"
    for bad, says in (("bogus", "unknown mount option 'bogus'"), ("sync=now", "sync= takes batch or close"),
                      ("fsname=x", "unknown mount option 'fsname'")):
        with pytest.raises(PffsError) as e:
            parse_options([bad])
        assert str(e.value) == says


def test_the_command_line_mount_fuse3_runs_is_pffs_mount():
    """`pffs STORE MOUNTPOINT -o OPTS` (what mount -t fuse.pffs and fstab run) is
    `pffs mount --store STORE -o OPTS MOUNTPOINT`; nothing else is taken for it."""
    a = cli.helper_args(["/srv/kv", "/mnt/kv", "-o", "rw,noatime,dev,suid"])
    assert a is not None and a.func is cli.cmd_mount
    assert (a.cmd, a.store, a.mountpoint, a.o, a.foreground, a.cache) == \
        ("mount", "/srv/kv", "/mnt/kv", ["rw,noatime,dev,suid"], False, None)
    b = cli.helper_args(["s3://bucket/kv", "/m", "-oro", "-o", "allow_other", "-f"])
    assert b is not None and (b.store, b.o, b.foreground) == ("s3://bucket/kv", ["ro", "allow_other"], True)
    for argv in (["frok", "a", "b"], ["mout", "/m", "-o", "rw"], ["stats", "/m", "-o", "rw"], ["/s", "/m"],
                 ["/s", "/m", "-o"], ["/s", "/m", "--store", "/x", "-o", "rw"], ["/s", "/m", "/n", "-o", "rw"],
                 ["mount", "/m", "-o", "rw"]):
        assert cli.helper_args(argv) is None, argv


def test_wait_says_saved_failed_or_timed_out(tmp_path):
    """pffs wait: exit 2 while neither the session nor its failure record is
    there, 1 with the record's line, 0 once the session's manifest is there."""
    s = tmp_path / "agent-a"
    r = run("wait", str(s), "--timeout", "0.05")
    assert r.returncode == 2 and "agent-a.save-failed" in r.stderr, r.stderr
    (tmp_path / "agent-a.save-failed").write_text("pffs_save 'agent-a': [Errno 28] No space left on device\n")
    r = run("wait", str(s), "--timeout", "0.05")
    assert r.returncode == 1 and r.stderr.strip().endswith("No space left on device"), r.stderr
    s.mkdir()
    (s / "manifest.json").write_text("{}")
    r = run("wait", str(s))
    assert r.returncode == 0 and r.stdout.strip() == f"{s}: saved", r.stdout
