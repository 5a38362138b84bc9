"""Token chain keys (SPEC §7), as engines import them: the names of
:mod:`pffs.tokenkeys`, where they are computed.

The keys sit below the namespace, whose prefix index keys page lists with
them; this module gives engines the same functions under pffs.client.  It
imports nothing but :mod:`pffs.tokenkeys` (the standard library and
:mod:`pffs.manifest` under it).
"""

from __future__ import annotations

from pffs.tokenkeys import (
    I64_MAX,
    INPUTS_FIELD,
    U32_MAX,
    WIDE_TAG,
    chain_keys,
    key_namespace,
    keys_value,
    manifest_namespace,
    model_identity,
    page_keys,
    pairs_value,
    parse_keys_value,
    parse_pairs_value,
    seq_page_keys,
    sglang_seed,
)

__all__ = [
    "I64_MAX", "INPUTS_FIELD", "U32_MAX", "WIDE_TAG", "chain_keys", "key_namespace", "keys_value",
    "manifest_namespace", "model_identity", "page_keys", "pairs_value", "parse_keys_value",
    "parse_pairs_value", "seq_page_keys", "sglang_seed",
]
