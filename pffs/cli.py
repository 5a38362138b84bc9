"""The ``pffs`` command line. Errors are one line on stderr and a non-zero exit."""

from __future__ import annotations

import os
import sys

from pffs import __version__
from pffs.errors import PffsError
from pffs.names import CONTROL_DIR, STATS_NAME

TYPE_CHECKING = False   # (typing.TYPE_CHECKING, without importing typing: see main)
if TYPE_CHECKING:
    import argparse
    from typing import Callable


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class Progress:
    """A one-line progress display on stderr when it is a terminal."""

    def __init__(self, what: str):
        self.what = what
        self.tty = sys.stderr.isatty()
        self.last = -1

    def __call__(self, done: int, total: int) -> None:
        if not self.tty or not total:
            return
        pct = done * 100 // total
        if pct != self.last:
            self.last = pct
            sys.stderr.write(f"\r{self.what}: {done}/{total} ({pct}%)")
            if done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def _store(args):
    from pffs.store.storedir import StoreDir
    return StoreDir(args.store, getattr(args, "codec", None))


def cmd_stats(args) -> int:
    import json

    from pffs import namespace
    if args.mountpoint:
        path = os.path.join(args.mountpoint, CONTROL_DIR, STATS_NAME)
        try:
            with open(path) as f:
                figures = json.load(f)
        except OSError as e:
            raise PffsError(f"{args.mountpoint}: not a mounted pffs ({e.strerror})") from None
    else:
        st = _store(args)
        if not st.exists():
            raise PffsError(f"{st.root}: no pffs store here")
        conn = namespace.open_db(st.root, create_missing=False)
        try:
            figures = namespace.stats(conn).to_json()
        finally:
            conn.close()
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        for k, v in figures.items():
            extra = f"  ({_human(v)})" if k.endswith("_bytes") else ""
            print(f"{k:18} {v}{extra}")
    return 0


def cmd_du(args) -> int:
    import json

    from pffs.client.du import du
    rows, together = du(args.paths)
    if args.json:
        out: dict = {"paths": [{"path": path, **u.to_json()} for path, u in rows]}
        if together is not None:
            out["together"] = together.to_json()
        print(json.dumps(out, indent=2))
        return 0
    if together is not None:
        rows.append(("(together)", together))
    print(f"{'Total':>10} {'Shared':>10} {'Exclusive':>10} {'Frees':>10}  Path")
    for path, u in rows:
        sizes = (u.logical_bytes, u.shared_bytes, u.exclusive_bytes, u.exclusive_stored_bytes)
        print(" ".join(f"{_human(n):>10}" for n in sizes) + f"  {path}")
    return 0


def cmd_check(args) -> int:
    return check_store(_store(args), read_data=args.read_data, repair=args.repair,
                       progress=Progress("checking blobs"))


def check_store(store, *, read_data: bool = False, repair: bool = False,
        progress: Callable[[int, int], None] | None = None, out=print) -> int:
    """``pffs check``: lock the unmounted store, check (and repair), print; the exit status."""
    from pffs import namespace as ns
    from pffs.maint.check import check
    from pffs.maint.repair import repair as do_repair
    # Without its database a store is still one if it has blobs or snapshots: repair rebuilds it.
    rebuildable = store.snapshot_dir.is_dir() or store.blobs.blob_root.is_dir()
    if not store.exists() and not (repair and rebuildable):
        raise PffsError(f"{store.root}: no pffs store here")
    store.lock("pffs check --repair" if repair else "pffs check")
    try:
        if repair:
            result = do_repair(store, read_data=read_data, progress=progress,
                               say=lambda line: out(f"repaired: {line}"))
            if result.report is None:
                raise PffsError(f"{store.root}: the check after the repair did not run")
            report = result.report
            if not result.actions:
                out("nothing to repair")
        else:
            try:
                conn = ns.open_db(store.root, create_missing=False)
            except ns.DamagedDatabase as e:
                out(f"DAMAGE: {e}")
                return 1
            try:
                report = check(conn, store.blobs, read_data=read_data, progress=progress)
            finally:
                conn.close()
    finally:
        store.unlock()
    for line in report.notes:
        out(f"note: {line}")
    for line in report.damage:
        out(f"DAMAGE: {line}")
    c = report.counts
    verified = " read and verified" if read_data and not repair else ""
    out(f"{c.get('sessions', 0)} sessions, {c.get('blobs_on_disk', 0)} blobs{verified},"
        f" {len(report.damage)} damaged{' after repair' if repair else ''}")
    return 0 if report.clean else 1


def cmd_gc(args) -> int:
    from pffs.maint import gc
    from pffs.store.s3 import is_remote
    if is_remote(args.store):
        from pffs.bucket import transfer as remote
        rb = remote.collect_cli(args.store, grace=gc.parse_duration(args.grace), dry_run=args.dry_run,
                                progress=Progress("sweeping the bucket"))
        print(f"gc: {rb.summary()}")
        return 0
    r = gc.collect(_store(args), grace=gc.parse_duration(args.grace), dry_run=args.dry_run,
                   progress=Progress("sweeping"))
    print(f"gc: {r.summary()}")
    return 0


def cmd_prune(args) -> int:
    from pffs.maint import gc, prune
    from pffs.store.storedir import StoreDir
    older = gc.parse_duration(args.older_than) if args.older_than is not None else None
    _, store = prune.prune(args.path, keep_last=args.keep_last, older_than=older, dry_run=args.dry_run)
    from pffs.store.s3 import is_remote
    if is_remote(store):
        from pffs.bucket import transfer as remote
        summary = remote.collect_cli(store, grace=gc.parse_duration(args.grace), dry_run=args.dry_run,
                                     progress=Progress("sweeping the bucket")).summary()
    else:
        summary = gc.collect(StoreDir(store), grace=gc.parse_duration(args.grace),
                             dry_run=args.dry_run, progress=Progress("sweeping")).summary()
    print(f"gc: {summary}")
    return 0


def _write_out(text: str) -> None:
    """*text* to stdout; a reader that stopped early (``| head``) is no error."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def cmd_tree(args) -> int:
    from pathlib import Path

    from pffs.client import prefixes, tree_svg, tree_text
    from pffs.client.digests import read_sessions
    from pffs.client.mounted import pffs_root
    if args.lines is not None and args.lines < 0:
        raise PffsError("--lines takes a number >= 0 (0: every session)")
    top = Path(args.path or ".").absolute()
    root = pffs_root(top)
    if root is None:
        raise PffsError(f"{top}: not inside a mounted pffs" + ("" if args.path else " (give a folder of one)"))
    if args.path is None:
        top = root
    if not top.exists():
        raise PffsError(f"{top}: no such file or directory")
    if not top.is_dir():
        raise PffsError(f"{top}: not a directory")
    found = list(read_sessions(top, root))
    tree = prefixes.build((s.name, s.pages, s.tokens) for s in found)
    differ = sum(1 for s in found if s.differ)
    missing = sum(1 for s in found if s.missing)
    title = args.path or str(top)
    if args.svg is None:
        rows = prefixes.layout(tree, 60 if args.lines is None else args.lines)
        _write_out("\n".join(tree_text.draw(title, tree, rows, differ=differ, missing=missing)) + "\n")
        return 0
    rows = prefixes.layout(tree, 1000 if args.lines is None else args.lines)
    svg = tree_svg.draw(title, tree, rows, differ=differ, missing=missing)
    if args.svg == "-":
        _write_out(svg)
        return 0
    with open(args.svg, "w") as f:
        f.write(svg)
    shown = sum(1 for r in prefixes.walk_rows(rows) if r.kind in ("leaf", "end"))
    print(f"{args.svg}: {tree_text.sessions(tree.n_sessions)}, {shown} drawn by name")
    return 0


def cmd_mount(args) -> int:
    if args.foreground and args.own_process:
        from pffs.daemon import heap
        heap.reexec_with_thp()   # (before the daemon's imports: its malloc settings)
    from pffs.daemon import mount as daemon
    opts = daemon.parse_options(args.o)
    store = args.store
    if args.cache or (store or "").startswith("s3://"):
        from pffs.store.s3 import url_of
        from pffs.store.storedir import StoreDir
        if url_of(store) is None:
            raise PffsError("--cache is for s3:// stores (a local store is its own folder)")
        # Bind the cache folder to the bucket; the daemon then opens the store by its folder.
        store = str(StoreDir(store, cache=args.cache, remote=opts.remote).root)
    if args.foreground:
        return daemon.run(store, args.mountpoint, opts, foreground=True)
    daemon.spawn(store, args.mountpoint, args.o)
    return 0


def cmd_umount(args) -> int:
    from pffs.client import mounted as tools
    tools.umount(args.mountpoint)
    return 0


def cmd_fork(args) -> int:
    from pffs.client.fork import fork
    n = fork(args.src, args.dst)
    print(f"{args.dst}: forked from {args.src}, {n} pages")
    return 0


class _ForkArgs:
    """``pffs fork SRC DST`` as argparse would give it (see :func:`main`)."""

    cmd, func = "fork", staticmethod(cmd_fork)

    def __init__(self, src: str, dst: str):
        self.src, self.dst = src, dst


def cmd_seal(args) -> int:
    from pffs.client import mounted as tools
    n, changed = tools.seal(args.session)
    print(f"{args.session}: manifest.json lists {n} pages ({changed} changed)")
    return 0


def _default_mountpoint():
    from pathlib import Path
    env = os.environ.get("PFFS_MOUNT")
    if env:
        return Path(env)
    if os.getuid() == 0:
        return Path("/mnt/kvcache")
    return Path.home() / "kvcache"


def cmd_demo(args) -> int:
    """Mount (unless mounted) and run the engine bridge's demo in its own process
    (``python -m engine_bridge.demo``: pffs itself never imports the bridge)."""
    import subprocess
    from pathlib import Path

    from pffs.client import mounted as tools
    from pffs.daemon import mount as daemon
    demo = [sys.executable, "-m", "engine_bridge.demo", "--engine", args.engine]
    # The engine is checked before anything is mounted: one line if it cannot run here.
    r = subprocess.run(demo + ["--check"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        lines = r.stdout.strip().splitlines() or [f"status {r.returncode}"]
        raise PffsError(f"demo: {lines[-1]}")
    mnt = Path(args.mountpoint) if args.mountpoint else _default_mountpoint()
    if tools.pffs_root(mnt) == mnt.absolute():
        print(f"using the pffs mounted on {mnt}")
    else:
        mnt.mkdir(parents=True, exist_ok=True)
        daemon.spawn(args.store, str(mnt), [])
        from pffs.store.storedir import StoreDir
        print(f"mounted store {StoreDir(args.store).root} on {mnt}", flush=True)
    rc = subprocess.run(demo + ["--dtype", args.dtype, "--tokens", str(args.tokens), str(mnt)]).returncode
    print(f"\nthe mount stays up: try ls -l {mnt}/demo/a/pages, cat {mnt}/demo/a/manifest.json;"
          f" pffs umount {mnt} when done")
    return 0 if rc == 0 else 1


def _mount_args(s) -> None:
    s.add_argument("--store", help="store directory (default $PFFS_STORE or ~/.local/share/pffs),"
                   " or s3://BUCKET/PREFIX")
    s.add_argument("--cache", help="with an s3:// store: the local folder for its namespace and blob"
                   " cache (default under $XDG_CACHE_HOME/pffs)")
    s.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground")
    s.add_argument("-o", action="append", default=[], metavar="OPTS",
                   help="allow_other, ro, cache_size=SIZE, max_size=SIZE, codec=NAME, sync=close;"
                   " mount(8)'s (noatime, nodev, nosuid, nofail, ...); for S3 also"
                   " endpoint=URL, region=, access_key=, secret_key=, s3_timeout=SECONDS, lease=AGE")
    s.add_argument("mountpoint")
    s.set_defaults(func=cmd_mount)


def _umount_args(s) -> None:
    s.add_argument("mountpoint")
    s.set_defaults(func=cmd_umount)


def _fork_args(s) -> None:
    s.add_argument("src")
    s.add_argument("dst")
    s.set_defaults(func=cmd_fork)


def _seal_args(s) -> None:
    s.add_argument("session")
    s.set_defaults(func=cmd_seal)


def _demo_args(s) -> None:
    s.add_argument("--store", help="store directory (default $PFFS_STORE or ~/.local/share/pffs)")
    s.add_argument("--mountpoint", help="where to mount (default $PFFS_MOUNT, /mnt/kvcache as root,"
                   " else ~/kvcache); an existing pffs mount there is used")
    s.add_argument("--dtype", choices=["f32", "bf16"], default="bf16")
    s.add_argument("--tokens", type=int, default=40, help="tokens to decode before and after")
    s.add_argument("--engine", choices=["reference", "transformers"], default="reference",
                   help="the engine whose KV cache is saved and restored")
    s.set_defaults(func=cmd_demo)


def _stats_args(s) -> None:
    s.add_argument("mountpoint", nargs="?", help="a mounted pffs (else --store)")
    s.add_argument("--store", help="store directory (default $PFFS_STORE or ~/.local/share/pffs)")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_stats)


def _du_args(s) -> None:
    s.add_argument("paths", nargs="+", metavar="PATH", help="a session or folder in a mounted pffs")
    s.add_argument("--json", action="store_true", help="print JSON (bytes)")
    s.set_defaults(func=cmd_du)


def _client_args(module: str, hook: str):
    """A command whose arguments a pffs.client module adds (imported when it is built)."""
    def add(s) -> None:
        import importlib
        getattr(importlib.import_module(module), hook)(s)
    return add


def _check_args(s) -> None:
    s.add_argument("--store", help="store directory")
    s.add_argument("--read-data", action="store_true", help="read, decompress and re-hash every blob")
    s.add_argument("--repair", action="store_true",
                   help="fix what can be fixed without losing intact data (damaged files go to /lost+found)")
    s.set_defaults(func=cmd_check)


def _gc_args(s) -> None:
    s.add_argument("--store", help="store directory (default $PFFS_STORE or ~/.local/share/pffs)")
    s.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    s.add_argument("--grace", default="10m", metavar="AGE",
                   help="keep unnamed blobs younger than this (default 10m)")
    s.set_defaults(func=cmd_gc)


def _prune_args(s) -> None:
    s.add_argument("path", help="a folder in a mounted pffs holding sessions")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--keep-last", type=int, metavar="N", help="keep the N newest sessions")
    g.add_argument("--older-than", metavar="AGE", help="remove sessions older than AGE (90s, 10m, 12h, 7d)")
    s.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    s.add_argument("--grace", default="10m", metavar="AGE", help="gc's grace period (default 10m)")
    s.set_defaults(func=cmd_prune)


def _tree_args(s) -> None:
    s.add_argument("path", nargs="?", help="a folder in a mounted pffs (default: the root of the mount"
                   " holding the current folder)")
    s.add_argument("--svg", metavar="FILE", help="write the tree as a standalone SVG picture ('-': stdout)")
    s.add_argument("--lines", type=int, metavar="N", help="show at most N lines below the first, the"
                   " biggest branches first (default 60; 1000 in the SVG; 0: all)")
    s.set_defaults(func=cmd_tree)


def _remote(name: str):
    """A command of pffs.bucket.transfer, imported when it runs (S3 clients are slow to import)."""
    def run(args):
        from pffs.bucket import transfer as remote
        return getattr(remote, name)(args)
    return run


_WHERE = "store: s3://BUCKET/PREFIX or its cache folder (default: the mount holding the path)"


def _push_args(s) -> None:
    s.add_argument("session", help="a session folder in a mount of an S3 store")
    s.add_argument("name", nargs="?", help="published name (default: the folder's name)")
    s.add_argument("--store", help=_WHERE)
    s.add_argument("--force", action="store_true", help="replace a session published under NAME")
    s.set_defaults(func=_remote("_cmd_push"))


def _pull_args(s) -> None:
    s.add_argument("name")
    s.add_argument("dest", help="new folder in a mount of the same S3 store")
    s.add_argument("--store", help="the store published to (checked against DEST's mount)")
    s.set_defaults(func=_remote("_cmd_pull"))


def _ls_remote_args(s) -> None:
    s.add_argument("path", nargs="?", help="a path in a mounted pffs (default: the current folder)")
    s.add_argument("--store", help=_WHERE)
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=_remote("_cmd_ls_remote"))


def _rm_remote_args(s) -> None:
    s.add_argument("name")
    s.add_argument("path", nargs="?", help="a path in a mounted pffs (default: the current folder)")
    s.add_argument("--store", help=_WHERE)
    s.set_defaults(func=_remote("_cmd_rm_remote"))


# (name, help, what adds its arguments), in the order `pffs --help` lists them.
COMMANDS = [
    ("mount", "mount a store", _mount_args),
    ("umount", "unmount and wait for the daemon to finish", _umount_args),
    ("fork", "fork a session without moving page bytes", _fork_args),
    ("seal", "rewrite a session's manifest.json from its page files", _seal_args),
    ("wait", "wait until an engine's save of a session is there (exit 0) or failed (exit 1)",
     _client_args("pffs.client.wait", "add_arguments")),
    ("demo", "save, fork and restore a KV cache of the reference engine", _demo_args),
    ("stats", "store figures: sessions, bytes, dedup and compression ratios", _stats_args),
    ("du", "what sessions or folders share, hold alone, and would give back if removed", _du_args),
    ("check", "check an unmounted store for damage", _check_args),
    ("gc", "remove blobs no file holds and no manifest lists (mounted or not)", _gc_args),
    ("prune", "remove old sessions under a folder of a mounted pffs, then gc", _prune_args),
    ("tree", "draw the sessions under a folder as the tree of the page prefixes they share", _tree_args),
    ("prefix", "who holds a session's token prefix, page by page (the prefix index)", _client_args("pffs.client.prefix_lookup", "add_arguments")),
    ("from-tokens", "make a session of the pages the store holds for a token sequence (the prefix index)",
     _client_args("pffs.client.from_tokens", "add_from_tokens_arguments")),
    ("tokens", "print a session's token ids (JSON): the prompt that starts from it", _client_args("pffs.client.from_tokens", "add_tokens_arguments")),
    ("push", "publish a session's manifest to the S3 bucket (no page bytes move)", _push_args),
    ("pull", "make a session published in the bucket appear in a mount", _pull_args),
    ("ls-remote", "list the sessions published in the bucket", _ls_remote_args),
    ("rm-remote", "withdraw a published session (its pages stay while referenced)", _rm_remote_args),
]


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for *argv*: when it names a command, that command's alone.

    Building every subparser costs more than a quick command like fork
    itself takes to start; ``pffs --help`` and a mistyped command get them all.
    """
    import argparse
    p = argparse.ArgumentParser(prog="pffs", description=__doc__ and
                                "KV caches as files: mount, inspect, fork and back up LLM KV caches.",
                                epilog="pffs STORE MOUNTPOINT -o OPTS mounts as pffs mount --store STORE"
                                " does: the form mount -t fuse.pffs and an fstab line run.")
    p.add_argument("--version", action="version", version=f"pffs {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    # The top level's only options (-h, --version) take no value: the first
    # other word is the command.
    first = next((a for a in argv or () if not a.startswith("-")), None)
    wanted = first if any(first == name for name, _, _ in COMMANDS) else None
    for name, help, add_args in COMMANDS:
        if wanted is None or name == wanted:
            add_args(sub.add_parser(name, help=help))
    return p


class _HelperArgs:
    """``pffs STORE MOUNTPOINT -o OPTS``, as ``pffs mount`` would take it (see
    :func:`helper_args`)."""

    cmd, func, cache = "mount", staticmethod(cmd_mount), None

    def __init__(self, store: str, mountpoint: str, o: list[str], foreground: bool):
        self.store, self.mountpoint, self.o, self.foreground = store, mountpoint, o, foreground
        self.own_process = False


def helper_args(argv: list[str]) -> _HelperArgs | None:
    """The command line mount(8) runs for a ``fuse.pffs`` mount (``mount -t
    fuse.pffs STORE MOUNTPOINT -o OPTS``, an fstab line), through mount.fuse3:
    ``pffs STORE MOUNTPOINT -o OPTS``; None for any other.

    mount.fuse3 always gives ``-o`` (it adds dev and suid, or nodev and nosuid
    are there), and STORE is a path with a slash in it or an s3:// URL: so a
    mistyped command (``pffs mout /mnt``) is still one.
    """
    words: list[str] = []
    opts: list[str] = []
    foreground = False
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-o" and i + 1 < len(argv):
            opts.append(argv[i + 1])
            i += 1
        elif a.startswith("-o") and len(a) > 2:
            opts.append(a[2:])
        elif a in ("-f", "--foreground"):
            foreground = True
        elif a.startswith("-"):
            return None
        else:
            words.append(a)
        i += 1
    if len(words) != 2 or not opts or "/" not in words[0] or any(words[0] == name for name, _, _ in COMMANDS):
        return None
    return _HelperArgs(words[0], words[1], opts, foreground)


def main(argv: list[str] | None = None) -> int:
    own_process = argv is None     # (this process's command line: cmd_mount may run it again)
    if argv is None:
        argv = sys.argv[1:]
    args: argparse.Namespace | _ForkArgs | _HelperArgs
    helper = helper_args(argv)
    if len(argv) == 3 and argv[0] == "fork" and not any(a.startswith("-") for a in argv[1:]):
        # The command scripts run most and a restore waits on, parsed
        # without argparse: it and what it imports (re, gettext, typing)
        # took longer than Python's own start (docs/performance.md).
        args = _ForkArgs(argv[1], argv[2])
    elif helper is not None:
        args = helper
        helper.own_process = own_process
    else:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        args.own_process = own_process
    try:
        return args.func(args)
    except PffsError as e:
        print(f"pffs {args.cmd}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"pffs {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"pffs {args.cmd}: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except Exception as e:
        # Only the commands that open the namespace import sqlite3 (which
        # costs a quick command like fork a tenth of its time).
        sqlite3 = sys.modules.get("sqlite3")
        if sqlite3 is None or not isinstance(e, sqlite3.Error):
            raise
        print(f"pffs {args.cmd}: namespace database: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
