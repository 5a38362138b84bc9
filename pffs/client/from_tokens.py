"""Named sessions from pages found by their tokens, and a session's tokens back.

``pffs from-tokens NAME --tokens FILE --like TEMPLATE`` makes the session
NAME of the longest run of the token sequence's full pages that the mount's
token-chain index holds (SPEC §7): pages any session holds, or an engine
stored by key alone (SGLang's HiCache tier, ``docs/engines.md`` §11).  The
key namespace, geometry, model and KV conventions are TEMPLATE's: a session
of the same model and geometry, or a manifest file (the SGLang backend
writes one, with no pages, under its root's ``.hicache/``).  The new
session's manifest lists those pages' blobs and the tokens they hold; its
close makes every page file appear (a metadata-only fork): no page byte is
read or written.

``pffs tokens SESSION`` prints a session's token ids as JSON: the prompt
that starts from it in an engine that finds it by tokens (SGLang, or vLLM
with ``pffs_load_prefix``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence

from pffs import manifest as mf
from pffs.client.chainkeys import chain_keys, manifest_namespace
from pffs.client.fork import mount_root, place_manifest
from pffs.client.prefix_lookup import longest_prefix, read_tokens
from pffs.errors import PffsError
from pffs.names import MANIFEST_NAME, PAGES_DIR


def read_template(like: str) -> tuple[mf.Manifest, dict]:
    """The manifest of *like* (a session folder or a manifest file): parsed, and as JSON."""
    path = os.path.join(like, MANIFEST_NAME) if os.path.isdir(like) else like
    try:
        with open(path, "rb") as f:
            data = f.read(mf.MAX_MANIFEST_BYTES + 1)
        return mf.parse(data), json.loads(data)
    except OSError as e:
        raise PffsError(f"{path}: {e.strerror}") from None
    except (mf.ManifestError, ValueError) as e:
        raise PffsError(f"{path}: not a manifest ({e})") from None


def from_tokens(dest: str, tokens: Sequence[int], like: str) -> tuple[int, int]:
    """Make session *dest* of the indexed pages of *tokens* in *like*'s namespace:
    (pages, tokens) it holds."""
    root = mount_root(os.path.dirname(os.path.abspath(dest)) or ".")
    if root is None:
        raise PffsError(f"{dest}: not in a mounted pffs")
    if os.path.lexists(dest):
        raise PffsError(f"{dest}: exists")
    template, raw = read_template(like)
    t = template.page_size_tokens
    keys = chain_keys(tokens, t)
    if not keys:
        raise PffsError(f"{len(tokens)} tokens make no full page of {t}")
    digests = longest_prefix(root, manifest_namespace(raw), keys)
    if not digests:
        raise PffsError(f"the store holds no page of the first {t} tokens in the key namespace of {like}")
    n = len(digests)
    m = mf.Manifest(page_size_tokens=t, n_layers=template.n_layers, n_heads=template.n_heads,
                    head_dim=template.head_dim, dtype=template.dtype, pages=digests,
                    logical_seqs=[mf.LogicalSeq("tokens", list(range(n)), 0, list(tokens[:n * t]))],
                    layout=template.layout, model=template.model, kv=template.kv, engine=template.engine,
                    attention=template.attention)
    place_manifest(dest, m.to_json())
    shown = len(os.listdir(os.path.join(dest, PAGES_DIR)))
    if shown != n:
        shutil.rmtree(dest, ignore_errors=True)
        raise PffsError(f"{dest}: {shown} of its {n} pages appeared (a blob went meanwhile?): not made")
    return n, n * t


def from_tokens_command(dest: str, tokens_file: str, like: str, out=print) -> int:
    tokens = read_tokens(tokens_file)
    n, held = from_tokens(dest, tokens, like)
    t = held // n
    out(f"{dest}: {n} pages ({held} tokens) of the {len(tokens) // t} full pages of {len(tokens)} tokens")
    return 0


def tokens_command(session: str, seq: str | None, out=print) -> int:
    """``pffs tokens SESSION [--seq ID]``: the token ids of a sequence, as JSON."""
    m, _ = read_template(session)
    seqs = [s for s in m.logical_seqs if seq is None or s.id == seq]
    if not seqs:
        raise PffsError(f"{session}: no sequence {seq!r}")
    if seqs[0].token_ids is None:
        raise PffsError(f"{session}: its sequence {seqs[0].id!r} holds no token ids")
    out(json.dumps(seqs[0].token_ids, separators=(",", ":")))
    return 0


def add_from_tokens_arguments(s) -> None:
    s.add_argument("name", help="the new session (a path in a mounted pffs)")
    s.add_argument("--tokens", metavar="FILE", required=True, help="a JSON list of token ids")
    s.add_argument("--like", metavar="TEMPLATE", required=True,
                   help="a session (or a manifest file) of the model and geometry the pages have")
    s.set_defaults(func=lambda args: from_tokens_command(args.name, args.tokens, args.like))


def add_tokens_arguments(s) -> None:
    s.add_argument("session", help="a session folder (or its manifest.json)")
    s.add_argument("--seq", metavar="ID", help="the sequence (default the first)")
    s.set_defaults(func=lambda args: tokens_command(args.session, args.seq))
