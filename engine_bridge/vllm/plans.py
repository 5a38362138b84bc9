"""The vLLM connector's scheduler half: what a request asks, and what can be loaded.

Everything here runs on vLLM's scheduler thread, once per request (a plan
is made at the request's first admission and kept): it reads one
manifest.json and no page file, so its work does not grow with a session's
pages beyond parsing that manifest.  Whether each page is there and holds
its bytes is checked by the worker as it loads (a page that fails is
reported to vLLM, which computes it instead).

A request without a session name may load the longest prefix of its prompt
that the mount's token-chain index holds (SPEC §7): :func:`plan_prefix` asks
the index once per full page of the prompt (O(pages), no FUSE request), and
the worker reads those blobs by digest.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_bridge.core.bridge import SUPPORTED_LAYOUTS, check_manifest, read_manifest
from engine_bridge.core.pool import DEFAULT_KV
from engine_bridge.errors import BridgeError, Unfingerprinted
from engine_bridge.transport.choose import as_source
from engine_bridge.vllm.windows import loadable
from pffs.client.chainkeys import chain_keys, manifest_namespace
from pffs.errors import PffsError
from pffs.manifest import LogicalSeq, Manifest
from pffs.types import Digest

SAVE, LOAD = "pffs_save", "pffs_load"
#: A request field (true) loading a session whose manifest does not say which
#: weights wrote it (no ``model.weights_sha256``): the caller trusts it.
TRUST = "pffs_trust"
#: A request field (true) asking for the longest indexed prefix of the prompt.
PREFIX = "pffs_load_prefix"
#: The manifest's top-level field naming what else than tokens a request's KV
#: depends on (LoRA adapter, cache salt, multimodal inputs).
INPUTS = "inputs"


def session_path(root: Path, name: Any) -> Path:
    """``root/name`` for a session name: a relative path without ``.`` or ``..``."""
    if not isinstance(name, str) or not name or name.startswith("/") \
            or any(part in ("", ".", "..") for part in name.split("/")):
        raise ValueError(f"{name!r} is not a session name (a relative path under the root)")
    return root / name


def inputs_of(request: Any) -> dict[str, Any]:
    """What besides its tokens a request's KV depends on, as a manifest records
    it (empty for a plain request): the LoRA adapter, the sha256 of its cache
    salt (the salt itself is a secret), its multimodal inputs' hashes."""
    out: dict[str, Any] = {}
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        out["lora"] = {"name": lora.lora_name, "path": lora.lora_path or None}
    salt = getattr(request, "cache_salt", None)
    if salt:
        out["cache_salt_sha256"] = hashlib.sha256(str(salt).encode()).hexdigest()
    mm = [{"modality": f.modality, "hash": f.mm_hash or f.identifier}
          for f in getattr(request, "mm_features", None) or ()]
    if mm:
        out["multimodal"] = mm
    return out


def inputs_differ(saved: Any, asked: dict[str, Any]) -> str | None:
    """Why KV saved for inputs *saved* must not serve a request of *asked*, or None."""
    saved = saved if isinstance(saved, dict) else {}
    for key in sorted(saved.keys() | asked.keys()):
        if saved.get(key) != asked.get(key):
            what = {"lora": "LoRA adapter", "cache_salt_sha256": "cache_salt",
                    "multimodal": "multimodal inputs"}.get(key, key)
            return (f"the session was saved with another {what} than this request's "
                    f"({'none' if key not in saved else 'one'} there, "
                    f"{'none' if key not in asked else 'one'} here)")
    return None


@dataclass
class LoadPlan:
    """What a request can load from its session: the pages of its prompt's
    matching full pages, in order (page i holds tokens i*B ..)."""

    name: str
    path: Path | None = None
    pages: list[int] = field(default_factory=list)
    error: str | None = None
    loaded: int = 0                 # tokens the last admission loaded from pffs
    failed: int = 0                 # pages of a load that failed (none is tried after it)
    admitting: bool = False         # the scheduler asked what can be loaded; blocks come next
    digests: list[str] | None = None    # a prefix found by tokens: page i is blob digests[i]
    trust: bool = False             # the request trusts a session without a weights fingerprint


def seq_of(manifest: Manifest, seq_id: Any) -> LogicalSeq:
    seqs = manifest.logical_seqs
    if seq_id is None:
        if len(seqs) != 1:
            raise ValueError(f"the session holds {len(seqs)} sequences: name one with pffs_seq")
        return seqs[0]
    for s in seqs:
        if s.id == seq_id:
            return s
    raise ValueError(f"the session has no sequence {seq_id!r}")


def plan_load(root: Path, name: Any, params: dict[str, Any], prompt: list[int], block_size: int,
              geometry: dict[str, Any], model: dict[str, Any], inputs: dict[str, Any],
              kv: dict[str, Any] | None = None) -> LoadPlan:
    """Read and check session *name*'s manifest, and match *prompt* to its tokens.

    At most the prompt less its last token is loaded (vLLM computes that one
    to sample); only whole pages.  A session whose manifest has no weights
    fingerprint loads only when the request says ``"pffs_trust": true``.
    A refusal is ``plan.error``, one line."""
    plan = LoadPlan(str(name), trust=params.get(TRUST) is True)
    try:
        folder = session_path(root, name)
        if not folder.is_dir():
            raise ValueError(f"{folder}: no such file or folder")
        manifest = read_manifest(as_source(folder))
        try:
            check_manifest(manifest, geometry, kv or DEFAULT_KV, model, trust_unfingerprinted=plan.trust)
        except Unfingerprinted as e:
            raise Unfingerprinted(e.engine, f'"{TRUST}": true in kv_transfer_params') from None
        why = inputs_differ(manifest.extra.get(INPUTS), inputs)
        if why:
            raise ValueError(why)
        seq = seq_of(manifest, params.get("pffs_seq"))
        if seq.token_ids is None:
            raise ValueError("the session holds no token ids, so no prompt can be matched to it")
        n, limit = 0, min(len(seq.token_ids), len(prompt) - 1)
        while n < limit and seq.token_ids[n] == prompt[n]:
            n += 1
        m = n // block_size
        window = (kv or {}).get("window")
        if window and m:    # (a sliding-window model: pages whose window layers the session holds)
            m = loadable(m, seq.n_tokens(block_size), int(window["tokens"]), block_size)
            if not m:
                raise ValueError(f"the prompt's first {n} tokens end before the session's last "
                                 f"{window['tokens']} tokens, whose windowed layers alone it holds")
        pages = list(seq.page_ixs[:m])
        if len(set(pages)) != len(pages):
            raise ValueError("the sequence lists a page twice")
        plan.path, plan.pages = folder, pages
    except (OSError, ValueError, BridgeError) as e:
        plan.error = f"{LOAD} {name!r}: {e}"
    return plan


def prefix_manifest(geometry: dict[str, Any], model: dict[str, Any], digests: list[str],
                    kv: dict[str, Any] | None = None) -> bytes:
    """A manifest of *digests* as this engine's sessions are written (its model,
    geometry, layout and KV conventions): what a prefix found by tokens is read
    as, and what its key namespace is computed from."""
    return Manifest(**geometry, pages=[Digest(d) for d in digests], layout=SUPPORTED_LAYOUTS[0], model=model,
                    kv=dict(kv or DEFAULT_KV)).to_json()


def prefix_space(geometry: dict[str, Any], model: dict[str, Any], kv: dict[str, Any] | None = None) -> str:
    """The key namespace of this engine's sessions' pages (pffs.client.chainkeys)."""
    return manifest_namespace(json.loads(prefix_manifest(geometry, model, [], kv)))


def plan_prefix(index: Any, space: str, prompt: list[int], block_size: int,
                inputs: dict[str, Any], window: Any = None) -> LoadPlan:
    """The longest run of the prompt's full pages (less its last token) that
    *index* (a pffs.client.prefix_lookup.PrefixIndex) holds in *space*.  A
    request with other inputs (LoRA, salt, multimodal) finds nothing: keyed
    pages depend on their tokens alone."""
    plan = LoadPlan(PREFIX, digests=[])
    if inputs:
        return plan
    if window:
        plan.error = (f"{PREFIX}: a sliding-window model's pages found by tokens may lack their "
                      "windowed layers (each session holds them for its last tokens only): "
                      "load a session by name")
        return plan
    try:
        plan.digests = [str(d) for d in index.longest_prefix(space, chain_keys(prompt[:-1], block_size))]
        plan.pages = list(range(len(plan.digests)))
    except (PffsError, ValueError, OSError, sqlite3.Error) as e:
        plan.error = f"{PREFIX}: {e}"
    return plan
