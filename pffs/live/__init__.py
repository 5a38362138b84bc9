"""Live engines: the engine socket, ``MNT/engines/`` and page-in by copy (SPEC §3, §5).

- :mod:`.protocol` — messages and descriptors on the socket (stdlib only; the
  engine-side agent, ``engine_bridge.agent``, uses it too)
- :mod:`.channel` — the daemon's end of a connection, on trio
- :mod:`.server` — the socket, who may attach, registration
- :mod:`.engines` — an attached engine: requests, snapshots, page reads, page-in
- :mod:`.slots` — the shared staging slots and what they hold
- :mod:`.incoming` — sessions being copied into an engine, in memory
- :mod:`.view` — the FUSE side of ``engines/``

Importing this package imports nothing but the standard library.
"""
