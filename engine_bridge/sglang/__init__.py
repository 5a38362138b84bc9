"""SGLang: pffs as HiCache's storage tier (``PffsHiCacheStorage``, docs/engines.md §11).

Imported by SGLang's dynamic storage backend loader (``module_path``
``engine_bridge.sglang``); it needs SGLang installed.
"""

from engine_bridge.sglang.hicache import PffsHiCacheStorage

__all__ = ["PffsHiCacheStorage"]
