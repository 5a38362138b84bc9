"""The ways page bytes travel between the bridge and a session: every sink
and source, and finding a path's pffs mount and its store.

- :mod:`.session_io` — the sink and source protocols, and their bases with the defaults
- :mod:`.folders` — a session folder in any directory (a mount's: through FUSE)
- :mod:`.in_memory` — a session in memory
- :mod:`.mountinfo` — the pffs mount holding a path, and whether its store is usable here
- :mod:`.direct` — a session in a mount, page bytes straight to and from its store
- :mod:`.store_blobs` — pages as bare blobs of a mount's store (an attached engine's)
- :mod:`.store_puts` — pages put into a mount's store, pinned and the gc lock held (``PagePuts``)
- :mod:`.choose` — which of them a path gets (``as_sink``, ``as_source``)
"""
