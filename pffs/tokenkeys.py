"""Token chain keys (SPEC §7): the name of a full page of KV by the tokens before and in it.

Pure computation on the standard library, below the namespace: pffs's prefix
index keys page lists with it, and engines import it as
:mod:`pffs.client.chainkeys`.  Both compute the same keys from the same tokens.

A page's key is SGLang's HiCache storage key.  Matched against SGLang
``python/sglang/srt/mem_cache/cpp_utils/hash_binding.cpp`` (``hash_page``,
``hash_wide_page``; the native code behind ``mem_cache/utils.py``'s
``get_hash_str``) and ``mem_cache/utils.py``'s ``storage_namespace_seed``:

- ``k_i = sha256(k_{i-1} ‖ tokens of page i)``, ``k_{i-1}`` fed as its 32 raw
  bytes (SGLang's ``bytes.fromhex(prior_hash)``), nothing for the first page
  of an unseeded chain; keys are written as 64 lowercase hex digits;
- a page's tokens are little-endian u32 each; a page holding any token
  above 2**32 - 1 is hashed *wide*: one tag byte 0xff, then every token of
  that page as a little-endian u64 (the odd byte count keeps it apart from
  u32 pages); a token above 2**63 - 1, or negative, is refused (ValueError);
- only full pages are keyed: a short last page has no key;
- a request with an extra key or a cache salt seeds ``k_{-1}`` with
  :func:`sglang_seed` of them.

Keys live in a namespace (:func:`key_namespace`): the same tokens under
another model (other weights included), dtype, geometry or KV convention are
other bytes, so an index keeps keys per namespace and a key never matches
across namespaces.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from pffs.manifest import plain_scales

U32_MAX = 0xFFFF_FFFF
I64_MAX = 0x7FFF_FFFF_FFFF_FFFF
#: The tag byte of a page hashed wide (u64 tokens).
WIDE_TAG = b"\xff"
#: Manifest fields that change what a page's tokens mean beyond the tokens
#: (LoRA adapters, cache salts, multimodal inputs): a manifest with a
#: non-empty one is not keyed (see page_keys).
INPUTS_FIELD = "inputs"


def _page_bytes(page: Sequence[int]) -> bytes:
    """A page's tokens as SGLang hashes them: u32 LE, or the wide form."""
    lo = min(page)
    hi = max(page)
    if lo < 0 or hi > I64_MAX:
        raise ValueError(f"token id {lo if lo < 0 else hi} is not a non-negative int64")
    if hi <= U32_MAX:
        return struct.pack(f"<{len(page)}I", *page)
    return WIDE_TAG + struct.pack(f"<{len(page)}Q", *page)


def chain_keys(tokens: Sequence[int], page_size: int, seed: bytes = b"") -> list[str]:
    """The hex key of every full page of *tokens*, pages of *page_size* tokens, chained
    from *seed* (raw bytes: empty, or a digest such as :func:`sglang_seed`'s)."""
    if page_size <= 0:
        raise ValueError(f"page size must be positive, not {page_size}")
    keys: list[str] = []
    prior = bytes(seed)
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = hashlib.sha256(prior)
        h.update(_page_bytes(tokens[start:start + page_size]))
        prior = h.digest()
        keys.append(prior.hex())
    return keys


def sglang_seed(extra_key: str | None = None, cache_salt: str | None = None) -> bytes:
    """The seed SGLang starts a request's storage chain with (raw bytes; empty when it has
    neither an extra key nor a cache salt)."""
    if extra_key is None and cache_salt is None:
        return b""
    h = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):
        if part is None:
            h.update(b"\x00")
        else:
            encoded = part.encode("utf-8")
            h.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return h.digest()


def model_identity(model: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What names a model in a key namespace: its config's sha256 where the manifest
    gives one (names differ between hubs and mirrors), else its name and revision;
    with its weights' fingerprint (``weights_sha256``) where it gives one.  A model
    without a fingerprint is in namespaces of its own: never one an engine looks in."""
    if not model:
        return None
    if model.get("config_sha256"):
        ident = {"config_sha256": model["config_sha256"]}
    else:
        ident = {"name": model.get("name"), "revision": model.get("revision")}
    if model.get("weights_sha256"):
        ident["weights_sha256"] = model["weights_sha256"]
    return ident


def key_namespace(model: Mapping[str, Any] | None, dtype: str, n_layers: int, n_heads: int,
                  head_dim: int, page_size_tokens: int, kv: Mapping[str, Any] | None,
                  layout: str = "paged-batchinvariant-v1", attention: str = "mha") -> str:
    """The namespace of keys of pages with these bytes' meaning: sha256 (hex) of the
    canonical JSON of the model's identity, dtype, geometry, layout, attention (MLA
    pages in their own namespaces) and ``kv`` conventions."""
    ident: dict[str, Any] = {"model": model_identity(model), "dtype": dtype, "n_layers": n_layers,
                             "n_heads": n_heads, "head_dim": head_dim,
                             "page_size_tokens": page_size_tokens, "layout": layout,
                             "kv": _plain_kv(kv)}
    if attention != "mha":      # (absent: K/V pages' namespaces stay as they were)
        ident["attention"] = attention
    text = json.dumps(ident, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _plain_kv(kv: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """*kv* with its scales in one form (scales all 1.0 are null: the same pages' meaning)."""
    if not kv:
        return None
    out = dict(kv)
    if "scales" in out:
        out["scales"] = plain_scales(out["scales"])
    return out


def manifest_namespace(manifest: Mapping[str, Any]) -> str:
    """:func:`key_namespace` of a manifest.json's fields (as parsed JSON)."""
    return key_namespace(manifest.get("model"), manifest["dtype"], manifest["n_layers"],
                         manifest["n_heads"], manifest["head_dim"], manifest["page_size_tokens"],
                         manifest.get("kv"), manifest.get("layout", "paged-batchinvariant-v1"),
                         manifest.get("attention", "mha"))


def keys_value(space: str, keys: Sequence[str]) -> bytes:
    """The value of the ``user.pffs.prefix`` and ``user.pffs.prefix.touch`` xattrs."""
    return " ".join([space, *keys]).encode("ascii")


def parse_keys_value(value: bytes) -> tuple[str, list[str]]:
    """(namespace, keys) of an xattr value made by :func:`keys_value` (ValueError if it is not)."""
    try:
        words = value.decode("ascii").split()
    except UnicodeDecodeError:
        raise ValueError("not ASCII") from None
    if len(words) < 2 or not all(len(w) == 64 and all(c in "0123456789abcdef" for c in w) for w in words):
        raise ValueError("not a namespace and keys of 64 lowercase hex digits each")
    return words[0], words[1:]


def pairs_value(space: str, pairs: Sequence[tuple[str, str]]) -> bytes:
    """The value of ``user.pffs.prefix.put``: *space*, then each (key, blob sha256 hex)."""
    return " ".join([space, *(w for pair in pairs for w in pair)]).encode("ascii")


def parse_pairs_value(value: bytes) -> tuple[str, list[tuple[str, str]]]:
    """(namespace, [(key, sha256 hex)]) of a value made by :func:`pairs_value`
    (ValueError if it is not)."""
    space, words = parse_keys_value(value)
    if len(words) % 2:
        raise ValueError("not pairs of a key and a blob's sha256")
    return space, list(zip(words[0::2], words[1::2]))


def seq_page_keys(page_ixs: Sequence[int], token_ids: Sequence[int], page_size: int,
                  seed: bytes = b"") -> list[tuple[int, str]]:
    """(page index, key) of each full page of one logical sequence."""
    keys = chain_keys(token_ids, page_size, seed)
    return list(zip(page_ixs, keys))


def page_keys(manifest: Mapping[str, Any]) -> list[tuple[int, str]]:
    """(page index, key) of every full page of every logical sequence of a manifest.json
    (as parsed JSON) that carries ``token_ids``, each page once (a page two sequences
    share is keyed by the first).  Empty for a manifest whose top-level ``inputs`` is
    present and not empty: its pages' meaning depends on more than the tokens."""
    if manifest.get(INPUTS_FIELD):
        return []
    out: dict[int, str] = {}
    size = manifest["page_size_tokens"]
    for seq in manifest.get("logical_seqs") or ():
        toks = seq.get("token_ids")
        if not toks:
            continue
        for ix, key in seq_page_keys(seq.get("page_ixs") or (), toks, size):
            out.setdefault(ix, key)
    return sorted(out.items())
