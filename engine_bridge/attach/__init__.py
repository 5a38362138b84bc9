"""A live engine attached to a mounted pffs (``MNT/engines/NAME/``, contract §5).

- :mod:`.agent` — the engine's end of the daemon's socket: snapshots,
  gathers, stores, page-ins, saves and loads
- :mod:`.engine_adapter` — what an engine gives the agent, and the lock it steps under
- :mod:`.warm` — pages decoded ahead of a load while a session is copied in
- :mod:`.controls` — JSON control commands on stdin, for scripts and tests
- :mod:`.attach_cli` — ``python -m engine_bridge.attach``: one command for
  every engine (each engine's adapter is in its own folder)
"""
