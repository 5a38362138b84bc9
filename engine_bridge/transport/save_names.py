"""Which names a session may be saved under, below a root folder.

One function, :func:`save_place`, for every writer of a session on the
direct path (the vLLM connector checks a request's ``pffs_save`` with it
when the request arrives, and again on the worker just before the page-out;
:class:`engine_bridge.transport.direct.DirectSink` checks its destination
with it).  A name is a relative path of plain components.  Refused, each
with one line naming the rule:

- a NUL byte, an empty, ``.`` or ``..`` component, a ``.pffs`` component;
- a last component over :data:`MAX_LAST` bytes (its temp folder
  ``.NAME.tmp-<12 hex>`` must fit NAME_MAX, and so its failure record
  ``NAME.save-failed``);
- a last component ending in ``.save-failed`` (another save's failure record);
- a folder on the way that is a session (it holds manifest.json): a session
  inside another's folder or its ``pages/``;
- a folder on the way that is a symbolic link, or not a folder.

The folders are walked one component at a time from an fd of the root, each
opened with ``O_NOFOLLOW | O_DIRECTORY``, so a link never takes the walk out
of the root.  The writer then uses the path; a link put in place between the
check and the writer's own mkdir is not caught (the connector checks twice).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

from pffs.names import CONTROL_DIR, MANIFEST_NAME, SAVE_FAILED_SUFFIX

NAME_MAX = 255
#: A session's temp folder is ``.NAME.tmp-<12 hex>`` (engine_bridge.transport.folders).
TEMP_EXTRA = len(".") + len(".tmp-") + 12
#: The longest last component of a session name, in bytes.
MAX_LAST = NAME_MAX - max(TEMP_EXTRA, len(SAVE_FAILED_SUFFIX) + 2)

_WALK = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class BadName(ValueError):
    """A session name that breaks a rule (the message names it)."""


def check_name(name: Any) -> list[str]:
    """*name*'s components, or BadName saying which rule it breaks."""
    if not isinstance(name, str) or not name or name.startswith("/"):
        raise BadName("not a session name (a relative path under the root)")
    if "\0" in name:
        raise BadName("not a session name: it holds a NUL byte")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise BadName("not a session name: an empty, '.' or '..' part")
    if CONTROL_DIR in parts:
        raise BadName(f"not a session name: a {CONTROL_DIR!r} part (the mount's control folder)")
    if parts[-1].endswith(SAVE_FAILED_SUFFIX):
        raise BadName(f"not a session name: it ends in {SAVE_FAILED_SUFFIX!r} "
                      "(a failed save's record)")
    last = len(os.fsencode(parts[-1]))
    if last > MAX_LAST:
        raise BadName(f"not a session name: its last part has {last} bytes, over {MAX_LAST} "
                      f"(its temp folder and failure record must fit {NAME_MAX})")
    if any(len(os.fsencode(p)) > NAME_MAX for p in parts):
        raise BadName(f"not a session name: a part over {NAME_MAX} bytes")
    return parts


def save_place(root: str | os.PathLike, name: Any) -> Path:
    """``root/name`` once *name* passes every rule (BadName) and its folder is
    there beneath *root*, reached without a link (FileNotFoundError, BadName)."""
    parts = check_name(name)
    fd = os.open(root, _WALK)
    try:
        for i, part in enumerate(parts[:-1] + [None]):
            where = "/".join(parts[:i])
            if _holds_manifest(fd):
                raise BadName(f"{where or 'the root'} is a session (it holds {MANIFEST_NAME}); "
                              "a session is not saved inside another")
            if part is None:
                break
            try:
                nxt = os.open(part, _WALK, dir_fd=fd)
            except OSError as e:
                at = "/".join(parts[:i + 1])
                if e.errno == errno.ENOENT:
                    raise FileNotFoundError(errno.ENOENT, f"no folder {at!r} to save it in") from None
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(fd, part):
                    raise BadName(f"{at!r} is a symbolic link (a session stays beneath the root)") \
                        from None
                if e.errno == errno.ENOTDIR:
                    raise BadName(f"{at!r} is not a folder") from None
                raise
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)
    return Path(root, *parts)


def _holds_manifest(fd: int) -> bool:
    try:
        os.stat(MANIFEST_NAME, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _is_link(fd: int, part: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
