"""Clients of pffs: code that runs beside a mount (or an unmounted store), never in the daemon.

Engines use these modules (the engine bridge imports pffs through them):

- :mod:`.access`: the store behind a mount, the bridge's direct data path.
- :mod:`.chainkeys`: token chain keys and key namespaces (pffs.tokenkeys's names).
- :mod:`.prefix_lookup`: what a mount holds for a prompt's leading pages; also ``pffs prefix``.
- :mod:`.fork`: a new file created with its bytes (write_new); also ``pffs fork``.
- :mod:`.wait`: the record of a save that failed; also ``pffs wait``.
- :mod:`.offline`: sessions into and out of an unmounted store.

The command-line tools (pffs.cli) use the rest:

- :mod:`.mounted`: fork, seal, and finding a mount's daemon.
- :mod:`.du`: ``pffs du``.
- :mod:`.digests`, :mod:`.prefixes`, :mod:`.tree_text`, :mod:`.tree_svg`: ``pffs tree``.
- :mod:`.from_tokens`: ``pffs from-tokens`` and ``pffs tokens``.
"""
