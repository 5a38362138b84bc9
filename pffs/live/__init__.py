"""Live engines: the engine socket, ``MNT/engines/`` and page-in by copy (contract §3, §5).

- :mod:`.protocol` — messages and descriptors on the socket (stdlib only; the
  engine-side agent, ``engine_bridge.attach.agent``, uses it too)
- :mod:`.channel` — the daemon's end of a connection, on trio
- :mod:`.registry` — the attached engines by name and inode key, and their budgets
- :mod:`.server` — the socket, who may attach, registration
- :mod:`.errors` — what an engine's requests fail with
- :mod:`.engines` — an attached engine: requests, page reads, page-in
- :mod:`.sessions` — an attached engine's session listings and snapshots
- :mod:`.slots` — the shared staging slots and what they hold
- :mod:`.incoming` — sessions being copied into an engine, in memory
- :mod:`.view` — the FUSE side of ``engines/``: attributes, lookups, listings, reads
- :mod:`.writes` — the FUSE side of sessions copied in, and save/load
- :mod:`.handles` — what those two share: handles, the reader's process, errnos

Importing this package imports nothing but the standard library.
"""
