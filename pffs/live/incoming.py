"""A session being copied into an engine folder, gathered in daemon memory.

``cp -r SESSION MNT/engines/NAME/`` creates a folder, ``pages/``, the page
files and manifest.json, in any order.  They are kept here (never in the
store) as they arrive.  A page file counts as *arrived* once a close (flush)
followed its last write; the session is *complete* when manifest.json holds
a valid manifest and every page it lists has arrived.  Then the daemon pages
it into the engine (pffs.live.engines) and this tree goes away.

Inode numbers: the folder is the session's base inode; every other node gets
the next number of the session's range (see pffs.live.numbering).
"""

from __future__ import annotations

import fcntl
import os
import stat
from dataclasses import dataclass, field

from pffs import manifest as mf
from pffs.namespace import now_ns

PAGES = mf.PAGES_DIR.encode()
MANIFEST = mf.MANIFEST_NAME.encode()


@dataclass(eq=False)
class Node:
    """A file or folder of an incoming session."""

    ino: int
    mode: int
    uid: int
    gid: int
    parent: "Node | None" = None
    name: bytes = b""
    children: dict[bytes, "Node"] = field(default_factory=dict)    # folders (empty for files)
    # Folders among the children, kept as they change: a folder's link count
    # (2 + subdirs) is asked for at every GETATTR, one a file of a copy.
    subdirs: int = 0
    data: bytearray = field(default_factory=bytearray)              # files (empty for folders)
    # A file copied in whole from the mount's store by copy_file_range holds
    # the blob's name instead of its bytes (data empty): see hold_blob.
    blob: str | None = None
    blob_size: int = 0
    dirty: bool = False      # written since its last close
    arrived: bool = False    # closed at least once, not written since
    linked: bool = True
    version: int = 0         # bumped by every change of its bytes
    mtime_ns: int = field(default_factory=now_ns)
    atime_ns: int = 0
    ctime_ns: int = 0

    def __post_init__(self) -> None:
        self.atime_ns = self.ctime_ns = self.mtime_ns

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def size(self) -> int:
        return self.blob_size if self.blob is not None else len(self.data)


class IncomingSession:
    """The files of one session being copied into an engine, in memory."""

    def __init__(self, name: str, base_ino: int, mode: int, uid: int, gid: int):
        self.name = name
        self.base = base_ino
        self.root = Node(base_ino, stat.S_IFDIR | mode, uid, gid)
        self.nodes: dict[int, Node] = {base_ino: self.root}
        self._next = base_ino + 3
        self.bytes = 0
        #: "gathering" until complete, then "paging-in"; "gone" once dropped
        self.state = "gathering"
        self.manifest: mf.Manifest | None = None
        self.manifest_data: bytes | None = None
        self._arrived: set[int] = set()

    # -- tree -----------------------------------------------------------

    def make(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> Node:
        node = Node(self._next, mode, uid, gid, parent, name)
        self._next += 1
        parent.children[name] = node
        parent.subdirs += node.is_dir
        self.nodes[node.ino] = node
        parent.mtime_ns = parent.ctime_ns = now_ns()
        return node

    def detach(self, node: Node) -> int:
        """Take *node* out of its folder (open handles keep using it); returns the bytes freed."""
        parent = node.parent
        if parent is not None and parent.children.get(node.name) is node:
            del parent.children[node.name]
            parent.subdirs -= node.is_dir
            parent.mtime_ns = parent.ctime_ns = now_ns()
        if self.is_manifest(node):
            self.manifest = self.manifest_data = None
        self._forget_page(node)
        node.linked = False
        self.nodes.pop(node.ino, None)
        held = len(node.data)     # (a file held by name holds no memory)
        self.bytes -= held
        return held

    def move(self, node: Node, new_parent: Node, new_name: bytes) -> None:
        self._forget_page(node)
        was_manifest = self.is_manifest(node)
        old = node.parent
        assert old is not None      # only the root has none, and it is never moved
        del old.children[node.name]
        old.subdirs -= node.is_dir
        old.mtime_ns = old.ctime_ns = now_ns()
        node.parent, node.name = new_parent, new_name
        new_parent.children[new_name] = node
        new_parent.subdirs += node.is_dir
        new_parent.mtime_ns = new_parent.ctime_ns = node.ctime_ns = now_ns()
        if was_manifest:
            self.manifest = self.manifest_data = None
        if node.is_dir:
            # pages/ itself moved: which files are page files changed.
            pages = self.root.children.get(PAGES)
            self._arrived = set()
            if pages is not None and pages.is_dir:
                for child in pages.children.values():
                    self._note_page(child)
        else:
            self._note_page(node)

    def is_manifest(self, node: Node) -> bool:
        return node.parent is self.root and node.name == MANIFEST and not node.is_dir

    def page_index(self, node: Node) -> int | None:
        """Page index of a page file of this session (pages/NNNNNN), else None."""
        p = node.parent
        if node.is_dir or p is None or p.name != PAGES or p.parent is not self.root:
            return None
        return mf.parse_page_name(node.name)

    # -- bytes ----------------------------------------------------------

    def hold_blob(self, node: Node, digest: str, size: int) -> None:
        """Empty file *node* now holds the store's blob *digest* (*size* bytes),
        by name: nothing is held in memory, and an engine that can read the
        store takes the page from there (pffs.live.engines.LiveEngine.load_blobs)."""
        assert not node.data and node.blob is None
        node.blob, node.blob_size = digest, size
        self.changed(node)

    def unblob(self, node: Node, data: bytes | memoryview) -> int:
        """A file held by name gets its bytes (*data*, the blob's): how many bytes
        the session's memory grew by."""
        assert node.blob is not None and len(data) == node.blob_size
        node.data = bytearray(data)
        node.blob, node.blob_size = None, 0
        self.bytes += len(data)
        return len(data)

    def write(self, node: Node, off: int, buf: bytes) -> int:
        """Write into a file; returns how many bytes the session grew by."""
        data = node.data
        grow = max(0, off + len(buf) - len(data))
        if off > len(data):
            data.extend(bytes(off - len(data)))
        data[off:off + len(buf)] = buf
        self.bytes += grow
        self.changed(node)
        return grow

    def truncate(self, node: Node, size: int) -> int:
        if node.blob is not None:
            # (Only to nothing: a file held by name gets its bytes before any other change.)
            assert size == 0, "truncate of a file held by name"
            node.blob, node.blob_size = None, 0
            self.changed(node)
            return 0
        data = node.data
        grow = size - len(data)
        if grow > 0:
            data.extend(bytes(grow))
        else:
            del data[size:]
        self.bytes += grow
        self.changed(node)
        return grow

    def changed(self, node: Node) -> None:
        node.version += 1
        node.dirty = True
        node.arrived = False
        node.mtime_ns = node.ctime_ns = now_ns()
        self._forget_page(node)
        if self.is_manifest(node):
            self.manifest = self.manifest_data = None

    def closed(self, node: Node) -> None:
        """A close of *node*: what it holds now has arrived."""
        node.dirty = False
        node.arrived = True
        self._note_page(node)

    def set_manifest(self, m: mf.Manifest | None, data: bytes | None) -> None:
        self.manifest, self.manifest_data = m, data

    def _note_page(self, node: Node) -> None:
        ix = self.page_index(node)
        if ix is not None and node.arrived and node.linked:
            self._arrived.add(ix)

    def _forget_page(self, node: Node) -> None:
        ix = self.page_index(node)
        if ix is not None:
            self._arrived.discard(ix)

    # -- completeness ----------------------------------------------------

    def complete(self) -> bool:
        """manifest.json is valid and every page it lists has arrived."""
        m = self.manifest
        if m is None or self.state != "gathering":
            return False
        n = len(m.pages)
        if len(self._arrived) < n:
            return False
        return all(ix in self._arrived for ix in range(n))

    def page_nodes(self) -> list[Node]:
        """The page files manifest.json lists, in page order (complete sessions only)."""
        m = self.manifest
        assert m is not None, "page_nodes() of an incomplete session"
        if not m.pages:
            return []
        pages = self.root.children[PAGES].children
        return [pages[mf.page_name(ix).encode()] for ix in range(len(m.pages))]

    def live_names(self) -> dict[int, tuple[str, int | None]]:
        """What the engine's session has for each copied-in file and folder the
        kernel may still name by its inode: ``pages/`` ("pages"), manifest.json
        ("manifest") and each page file ("page", its index); see
        pffs.live.attrs.LiveAttrs.resolve."""
        out: dict[int, tuple[str, int | None]] = {}
        man = self.root.children.get(MANIFEST)
        if man is not None and not man.is_dir:
            out[man.ino] = ("manifest", None)
        pages = self.root.children.get(PAGES)
        if pages is not None and pages.is_dir:
            out[pages.ino] = ("pages", None)
            for name, node in pages.children.items():
                ix = mf.parse_page_name(name)
                if ix is not None and not node.is_dir:
                    out[node.ino] = ("page", ix)
        return out

    def drop(self) -> int:
        """Forget every byte (the session went into the engine or was refused)."""
        freed = self.bytes
        self.state = "gone"
        for node in self.nodes.values():
            node.linked = False
            if not node.is_dir:
                node.data = bytearray()
                node.blob, node.blob_size = None, 0
        self.nodes = {}
        self.root.children = {}
        self.root.subdirs = 0
        self.bytes = 0
        self._arrived.clear()
        return freed


def memfd_with(pages: list[bytearray], page_bytes: int, manifest: bytes) -> int:
    """A sealed memfd: page i at i*page_bytes (pages of another size left out), then the manifest."""
    fd = os.memfd_create("pffs-page-in", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        end = len(pages) * page_bytes
        os.ftruncate(fd, end + len(manifest))
        for i, data in enumerate(pages):
            if len(data) == page_bytes:
                _pwrite_all(fd, data, i * page_bytes)
        _pwrite_all(fd, manifest, end)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pwrite_all(fd: int, data: bytes | bytearray, off: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, off)
        view = view[n:]
        off += n
