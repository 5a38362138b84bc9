"""Live engines: the engine socket, ``MNT/engines/`` and page-in by copy (contract §3, §5).

- :mod:`.protocol` — messages and descriptors on the socket (stdlib only; the
  engine-side agent, ``engine_bridge.attach.agent``, uses it too)
- :mod:`.channel` — the daemon's end of a connection, on trio
- :mod:`.server` — the socket, who may attach, registration
- :mod:`.registry` — the attached engines by name and inode key, and their budgets
- :mod:`.numbering` — the inode and handle numbers of ``engines/``, and what
  the kernel may keep of it (the invalidations)
- :mod:`.errors` — what an engine's requests fail with
- :mod:`.engines` — an attached engine: its folder's sessions, snapshots, page-in;
  made of :mod:`.link` (requests and answers) and :mod:`.pages` (page bytes
  through :mod:`.slots`, the shared staging slots)
- :mod:`.incoming` — sessions being copied into an engine, in memory
- :mod:`.view` — the FUSE tree of ``engines/``, made of :mod:`.attrs` (what an
  inode is, its attributes), :mod:`.copyin` (sessions copied in, their
  page-in) and :mod:`.copyout` (live pages stored ahead of a copy out)
- :mod:`.handles` — what those share: handles, the reader's process, errnos,
  what they ask of the mount's store

Importing this package imports nothing but the standard library.
"""
