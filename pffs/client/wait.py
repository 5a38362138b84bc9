"""``pffs wait PATH``: until a session an engine was asked to save is there, or
its save failed.

An engine's save completes on its own time, after the request that asked for
it has finished (docs/engines.md §10).  Its outcome is visible in the folder
the session goes to: the session ``PATH`` appears whole (its manifest.json
last, in one commit), or a file ``PATH.save-failed`` holding one line that
says why.  Where that folder cannot hold the record (its mount went away, or
its daemon was killed), the engine keeps it outside any mount instead: a file
in :func:`state_dir`'s ``save-failed/`` named by the sha256 of ``PATH``'s
absolute path.  This polls for any of them, with a deadline.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from pffs.names import MANIFEST_NAME, SAVE_FAILED_SUFFIX

SAVED, FAILED, TIMED_OUT = 0, 1, 2


def failure_record(session: str | os.PathLike) -> Path:
    """Where a failed save of *session* leaves its reason."""
    p = Path(session)
    return p.with_name(p.name + SAVE_FAILED_SUFFIX)


def state_dir() -> Path:
    """This host's pffs records kept outside any mount: ``$PFFS_STATE_DIR``, else
    ``$XDG_STATE_HOME/pffs``, else ``~/.local/state/pffs`` (the engine and
    ``pffs wait`` must agree on it: the same user, or the same variable)."""
    given = os.environ.get("PFFS_STATE_DIR")
    if given:
        return Path(given)
    xdg = os.environ.get("XDG_STATE_HOME")
    return Path(xdg) / "pffs" if xdg else Path.home() / ".local" / "state" / "pffs"


def kept_record(session: str | os.PathLike) -> Path:
    """Where a failed save of *session* leaves its reason when its folder cannot:
    its first line the reason, its second *session*'s absolute path."""
    key = hashlib.sha256(os.fsencode(os.path.abspath(session))).hexdigest()
    return state_dir() / "save-failed" / key


def record_failure(session: str | os.PathLike, line: str, *, in_place: bool) -> Path:
    """Leave *line* as the reason the save of *session* failed: beside it when
    *in_place* and the folder takes it, else in :func:`kept_record`.  Where it went."""
    if in_place:
        record = failure_record(session)
        tmp = record.with_name(f".{record.name}~")
        try:
            tmp.write_text(line + "\n")
            os.replace(tmp, record)
            return record
        except (OSError, ValueError):
            pass    # (the folder went, or cannot be written: keep it outside)
    kept = kept_record(session)
    kept.parent.mkdir(parents=True, exist_ok=True)
    tmp = kept.with_name(f".{kept.name}.{os.getpid()}")
    tmp.write_text(f"{line}\n{os.path.abspath(session)}\n")
    os.replace(tmp, kept)
    return kept


def forget_failure(session: str | os.PathLike) -> None:
    """Drop an earlier save's kept failure record of *session* (a new save is scheduled)."""
    try:
        os.unlink(kept_record(session))
    except FileNotFoundError:
        pass


def _first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0] if text else "the save failed"


def outcome(session: str | os.PathLike) -> tuple[int, str] | None:
    """(SAVED, "") or (FAILED, reason) if the save of *session* has ended, else None."""
    try:
        if os.path.exists(os.path.join(session, MANIFEST_NAME)):
            return SAVED, ""
        return FAILED, _first_line(failure_record(session).read_text(errors="replace"))
    except OSError:
        pass    # (no record there, or the folder's mount does not answer)
    try:
        kept = kept_record(session).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    if kept[1:2] != [os.path.abspath(session)]:
        return None
    return FAILED, _first_line(kept[0])


def wait(session: str | os.PathLike, timeout: float | None = None) -> tuple[int, str]:
    """Poll :func:`outcome` (every 10 ms, up to every 250 ms) until the save
    ends or *timeout* seconds pass: (SAVED|FAILED|TIMED_OUT, reason)."""
    end = None if timeout is None else time.monotonic() + timeout
    pause = 0.01
    while True:
        got = outcome(session)
        if got is not None:
            return got
        if end is not None and time.monotonic() >= end:
            return TIMED_OUT, f"neither the session nor {failure_record(session).name} after {timeout:g} s"
        time.sleep(pause if end is None else max(0.0, min(pause, end - time.monotonic())))
        pause = min(pause * 2, 0.25)


def wait_command(session: str, timeout: float | None) -> int:
    """``pffs wait PATH [--timeout S]``: exit 0 saved, 1 failed (why on stderr), 2 timed out."""
    import sys
    code, why = wait(session, timeout)
    if code == SAVED:
        print(f"{session}: saved")
    else:
        print(f"pffs wait: {session}: {why}", file=sys.stderr)
    return code


def add_arguments(s) -> None:
    """``pffs wait``'s arguments (pffs.cli's parser)."""
    s.add_argument("session", help="where an engine was asked to save a session")
    s.add_argument("--timeout", type=float, metavar="SECONDS", help="give up after this long (exit 2)")
    s.set_defaults(func=lambda args: wait_command(args.session, args.timeout))
