"""The names a client of a mounted pffs sees, defined once: the daemon, pffs's
tools and the engine bridge all import them from here.

Each is a str; ``NAME_B`` is the same name as bytes, for the FUSE handlers
(which are given and compare names as bytes).
"""

# -- a session folder (contract §3) --------------------------------------------

MANIFEST_NAME = "manifest.json"
PAGES_DIR = "pages"

#: Beside a session an engine was asked to save, ``NAME`` + this suffix: a
#: one-line file saying why the save failed (an engine's connector writes it;
#: ``pffs wait NAME`` reads it).  A save that succeeds makes ``NAME`` appear
#: whole instead.
SAVE_FAILED_SUFFIX = ".save-failed"

# -- the mount's root ------------------------------------------------------------

#: Live engines' folders: ``engines/<name>/<session>/`` (contract §5).
ENGINES_DIR = "engines"
#: The hidden folder at the mount's root (not listed, reachable by name).
CONTROL_DIR = ".pffs"
#: Its files: the daemon's figures, its version, where its store is (for
#: engines' bridges on this host) and a link to the live-engine socket.
STATS_NAME = "stats.json"
VERSION_NAME = "version"
STORE_INFO_NAME = "store.json"
SOCKET_NAME = "engine.sock"

ENGINES_DIR_B = ENGINES_DIR.encode()
CONTROL_DIR_B = CONTROL_DIR.encode()
STATS_NAME_B = STATS_NAME.encode()
VERSION_NAME_B = VERSION_NAME.encode()
STORE_INFO_NAME_B = STORE_INFO_NAME.encode()
SOCKET_NAME_B = SOCKET_NAME.encode()

# -- the filesystem in /proc/self/mountinfo ------------------------------------

#: The mount's ``subtype=`` option, so its type reads ``FSTYPE``.
FS_SUBTYPE = "pffs"
FSTYPE = f"fuse.{FS_SUBTYPE}"

# -- extended attributes -----------------------------------------------------

#: Read-only, unlisted, on a file: ``sha256:<hex>`` of its bytes.
DIGEST_XATTR = "user.pffs.digest"
#: Read-only, unlisted, on a directory: how many names it holds.
ENTRIES_XATTR = "user.pffs.entries"
#: Read-only, unlisted, on a session folder: JSON saying which page files do
#: not hold the blob their manifest lists (pffs.fs.adoption.page_verdict).
PAGES_XATTR = "user.pffs.pages"
#: Read-only, unlisted, on the mount's root: the bytes of ``.pffs/store.json``.
STORE_XATTR = "user.pffs.store"
#: Write-only, on a session folder holding an empty ``pages/``: a path from the
#: mount's root to a manifest.json, forked there without its bytes crossing FUSE.
FORK_XATTR = "user.pffs.fork"
#: Write-only, on a live session ``engines/E/S``: a new session's path from the
#: mount's root, which engine E pages S out to itself.
SAVE_XATTR = "user.pffs.save"
#: Write-only, on an engine's folder ``engines/E``: JSON ``{"session": path
#: from the mount's root, "name": a session name}``, which E pages in itself.
LOAD_XATTR = "user.pffs.load"
#: On a file ``pffs repair`` put in ``lost+found``: why it is there.
LOST_XATTR = "user.pffs.lost"
#: Write-only, on a regular file holding one page: ``<namespace> <key>`` (hex,
#: pffs.client.chainkeys), which keeps the file's blob in the key-only prefix
#: cache under that key, whatever becomes of the file (SPEC §7).
PREFIX_XATTR = "user.pffs.prefix"
#: Write-only, on any file or folder: ``<namespace> <key> <key>...``, the
#: key-only prefix cache's rows of those keys marked used now (LRU).
PREFIX_TOUCH_XATTR = "user.pffs.prefix.touch"
#: Write-only, on the mount's root: ``<namespace> <key> <sha256> <key> <sha256>...``
#: (hex), blobs a client put beside the mount (the direct path) kept in the
#: key-only prefix cache under those keys: one request for a batch of pages
#: whose bytes never cross FUSE (SPEC §7).
PREFIX_PUT_XATTR = "user.pffs.prefix.put"

DIGEST_XATTR_B = DIGEST_XATTR.encode()
ENTRIES_XATTR_B = ENTRIES_XATTR.encode()
PAGES_XATTR_B = PAGES_XATTR.encode()
STORE_XATTR_B = STORE_XATTR.encode()
FORK_XATTR_B = FORK_XATTR.encode()
SAVE_XATTR_B = SAVE_XATTR.encode()
LOAD_XATTR_B = LOAD_XATTR.encode()
LOST_XATTR_B = LOST_XATTR.encode()
PREFIX_XATTR_B = PREFIX_XATTR.encode()
PREFIX_TOUCH_XATTR_B = PREFIX_TOUCH_XATTR.encode()
PREFIX_PUT_XATTR_B = PREFIX_PUT_XATTR.encode()

# -- the direct data path ------------------------------------------------------

#: Version of ``.pffs/store.json`` and of what a direct client may do with the
#: store (2: blob frames hold their name, pffs.codec; a client of 1 would
#: refuse them).  The daemon writes it; a bridge of another version goes
#: through the mount.
DIRECT_PROTOCOL = 2
