"""The manifest.json model: parse, validate and write (contract §2, §3.3).

Every refusal raises :class:`ManifestError` naming the field and the reason,
so the daemon can log one line and answer EINVAL.  Unknown top-level keys are
kept as they are; pffs never rewrites a user's manifest, and the canonical
writer is only used for manifests pffs itself creates.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pffs.errors import PffsError
from pffs.names import MANIFEST_NAME, PAGES_DIR  # noqa: F401 (part of this module's interface)
from pffs.types import Digest, PageIndex, is_digest

LAYOUTS = ("paged-batchinvariant-v1",)
DEFAULT_LAYOUT = LAYOUTS[0]
DTYPE_SIZES = {"bf16": 2, "f16": 2, "f32": 4, "fp8e4m3": 1, "fp8e5m2": 1}
#: What a page holds (contract §1, §1.1): K and V heads (``mha``, also when the
#: manifest says nothing), or one latent vector a token (``mla``).
ATTENTIONS = ("mha", "mla")


def plain_scales(scales: Any) -> Any:
    """``kv.scales`` in one form: None for null and for scales that are all 1.0
    (both say the values are not scaled, contract §1), else as given.  Sessions
    are compared, and their key namespaces computed, in this form."""
    if isinstance(scales, dict) and set(scales) <= {"k", "v"} and all(
            isinstance(v, list) and all(type(x) in (int, float) and x == 1 for x in v)
            for v in scales.values()):
        return None
    return scales

# Caps against hostile manifests; each is far above any real cache.
MAX_MANIFEST_BYTES = 64 << 20
MAX_PAGES = 1 << 20
MAX_SEQS = 1 << 16
MAX_TOKENS_PER_SEQ = 1 << 24
MAX_PAGE_BYTES = 256 << 20
MAX_DIM = 1 << 20
MAX_SEQ_ID_LEN = 255

_PAGE_NAME_RE = re.compile(r"[0-9]{6,}\Z")


class ManifestError(PffsError):
    """A manifest.json that pffs refuses; ``field`` names what is wrong."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def page_name(ix: int) -> str:
    """File name of page *ix* in ``pages/``: six digits, more when needed."""
    return f"{ix:06d}"


def parse_page_name(name: str | bytes) -> PageIndex | None:
    """Page index of a ``pages/`` entry name, or None if it is not a page file."""
    if isinstance(name, bytes):
        try:
            name = name.decode("ascii")
        except UnicodeDecodeError:
            return None
    if not _PAGE_NAME_RE.match(name):
        return None
    ix = int(name)
    # "0000001" is not the name of page 1: only the canonical spelling counts.
    return PageIndex(ix) if page_name(ix) == name else None


def page_bytes(n_layers: int, page_size_tokens: int, n_heads: int, head_dim: int,
               dtype: str, attention: str = "mha") -> int:
    """Size of one page file: K and V for every layer (contract §1), or one
    latent vector a token for every layer (``mla``, §1.1)."""
    pair = 1 if attention == "mla" else 2
    return pair * n_layers * page_size_tokens * n_heads * head_dim * DTYPE_SIZES[dtype]


@dataclass
class LogicalSeq:
    id: str
    page_ixs: list[int]
    fill_in_last_page: int = 0
    token_ids: list[int] | None = None

    def n_tokens(self, page_size_tokens: int) -> int:
        if not self.page_ixs:
            return 0
        last = self.fill_in_last_page or page_size_tokens
        return (len(self.page_ixs) - 1) * page_size_tokens + last

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "page_ixs": list(self.page_ixs),
                             "fill_in_last_page": self.fill_in_last_page}
        if self.token_ids is not None:
            d["token_ids"] = list(self.token_ids)
        return d


@dataclass
class Manifest:
    page_size_tokens: int
    n_layers: int
    n_heads: int
    head_dim: int
    dtype: str
    pages: list[Digest]
    logical_seqs: list[LogicalSeq] = field(default_factory=list)
    layout: str = DEFAULT_LAYOUT
    model: dict[str, Any] | None = None
    kv: dict[str, Any] | None = None
    engine: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    attention: str = "mha"

    @property
    def page_bytes(self) -> int:
        return page_bytes(self.n_layers, self.page_size_tokens, self.n_heads,
                          self.head_dim, self.dtype, self.attention)

    @property
    def geometry(self) -> dict[str, Any]:
        return {"page_size_tokens": self.page_size_tokens, "n_layers": self.n_layers,
                "n_heads": self.n_heads, "head_dim": self.head_dim, "dtype": self.dtype,
                "layout": self.layout, "attention": self.attention}

    def validate(self) -> "Manifest":
        """Check every rule; return self (ManifestError otherwise)."""
        _check(self.to_dict())
        return self

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "layout": self.layout,
            "page_size_tokens": self.page_size_tokens,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "pages": list(self.pages),
            "logical_seqs": [s.to_json() for s in self.logical_seqs],
            "model": self.model,
            "kv": self.kv,
            "engine": self.engine,
        }
        if self.attention != "mha":     # (absent means mha: K/V manifests keep their bytes)
            d = {"attention": self.attention, **d}
        for k, v in self.extra.items():
            d.setdefault(k, v)
        return d

    def to_json(self) -> bytes:
        """Canonical bytes: fixed key order, one page digest per line."""
        d = self.to_dict()
        lines = []
        for k, v in d.items():
            if k == "pages":
                body = ",\n    ".join(json.dumps(p) for p in v)
                val = f"[\n    {body}\n  ]" if v else "[]"
            elif k == "logical_seqs":
                body = ",\n    ".join(json.dumps(s, separators=(", ", ": ")) for s in v)
                val = f"[\n    {body}\n  ]" if v else "[]"
            else:
                val = json.dumps(v, separators=(", ", ": "), sort_keys=True)
            lines.append(f"  {json.dumps(k)}: {val}")
        return ("{\n" + ",\n".join(lines) + "\n}\n").encode()


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints_within(vals: list, lo: int, end: int | None) -> bool:
    """Whether every value is an int (not a bool) in [lo, end): the common case, checked
    in C; when False, the caller's loop finds the first offender for its message."""
    if not vals:
        return True
    if set(map(type, vals)) != {int}:
        return False
    return min(vals) >= lo and (end is None or max(vals) < end)


def _check(d: Any) -> tuple[list[Digest], list[LogicalSeq]]:
    if not isinstance(d, dict):
        raise ManifestError("manifest", "must be a JSON object")
    layout = d.get("layout", DEFAULT_LAYOUT)
    if layout not in LAYOUTS:
        raise ManifestError("layout", f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")
    for key in ("page_size_tokens", "n_layers", "n_heads", "head_dim"):
        if key not in d:
            raise ManifestError(key, "missing")
        v = d[key]
        if not _is_int(v):
            raise ManifestError(key, f"must be an integer, not {json.dumps(v)[:40]}")
        if v <= 0:
            raise ManifestError(key, f"must be positive, not {v}")
        if v > MAX_DIM:
            raise ManifestError(key, f"{v} exceeds the limit of {MAX_DIM}")
    dtype = d.get("dtype")
    if dtype is None:
        raise ManifestError("dtype", "missing")
    if dtype not in DTYPE_SIZES:
        raise ManifestError("dtype", f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_SIZES)})")
    attention = d.get("attention", "mha")
    if attention not in ATTENTIONS:
        raise ManifestError("attention", f"unknown attention {json.dumps(attention)[:40]} "
                            f"(known: {', '.join(ATTENTIONS)})")
    if attention == "mla" and d["n_heads"] != 1:
        raise ManifestError("n_heads", f"must be 1 for mla pages (one latent vector a token), not {d['n_heads']}")
    pb = page_bytes(d["n_layers"], d["page_size_tokens"], d["n_heads"], d["head_dim"], dtype, attention)
    if pb > MAX_PAGE_BYTES:
        raise ManifestError("geometry", f"pages of {pb} bytes exceed the limit of {MAX_PAGE_BYTES}")

    if "pages" in d and "page_table" in d:
        raise ManifestError("pages", "both pages and page_table given")
    raw_pages = d.get("pages", d.get("page_table"))
    fname = "pages" if "pages" in d else "page_table"
    if raw_pages is None:
        raise ManifestError("pages", "missing")
    if isinstance(raw_pages, dict):
        # The seed's form: physical page id -> digest, read in id order.
        items = []
        for k, v in raw_pages.items():
            if not isinstance(k, str) or not k.isdigit() or len(k) > 12:
                raise ManifestError(f"{fname}[{k!r}]", "page ids must be non-negative integers")
            items.append((int(k), k, v))
        items.sort()
        ids = [i for i, _, _ in items]
        if len(set(ids)) != len(ids):
            raise ManifestError(fname, "page ids repeat")
        pages_list = [(f"{fname}[{k!r}]", v) for _, k, v in items]
    elif isinstance(raw_pages, list):
        pages_list = [(f"{fname}[{i}]", v) for i, v in enumerate(raw_pages)]
    else:
        raise ManifestError(fname, "must be a list of digests (or an object of page id -> digest)")
    if len(pages_list) > MAX_PAGES:
        raise ManifestError(fname, f"{len(pages_list)} pages exceed the limit of {MAX_PAGES}")
    pages: list[Digest] = []
    for where, v in pages_list:
        if not is_digest(v):
            raise ManifestError(where, f"not a digest of the form sha256:<64 hex>: {json.dumps(v)[:80]}")
        pages.append(Digest(v))

    seqs_raw = d.get("logical_seqs", [])
    if not isinstance(seqs_raw, list):
        raise ManifestError("logical_seqs", "must be a list")
    if len(seqs_raw) > MAX_SEQS:
        raise ManifestError("logical_seqs", f"{len(seqs_raw)} sequences exceed the limit of {MAX_SEQS}")
    P = d["page_size_tokens"]
    seqs: list[LogicalSeq] = []
    seen_ids: set[str] = set()
    for i, s in enumerate(seqs_raw):
        where = f"logical_seqs[{i}]"
        if not isinstance(s, dict):
            raise ManifestError(where, "must be an object")
        sid = s.get("id")
        if not isinstance(sid, str) or not sid:
            raise ManifestError(f"{where}.id", "must be a non-empty string")
        if "/" in sid or "\0" in sid or sid in (".", "..") or len(sid.encode()) > MAX_SEQ_ID_LEN:
            raise ManifestError(f"{where}.id", f"{sid[:40]!r} is not usable as a file name")
        if sid in seen_ids:
            raise ManifestError(f"{where}.id", f"{sid!r} repeats")
        seen_ids.add(sid)
        ixs = s.get("page_ixs")
        if not isinstance(ixs, list):
            raise ManifestError(f"{where}.page_ixs", "must be a list of page indices")
        if len(ixs) * P > MAX_TOKENS_PER_SEQ:
            raise ManifestError(f"{where}.page_ixs", f"more than {MAX_TOKENS_PER_SEQ} tokens")
        for j, ix in enumerate(ixs if not _ints_within(ixs, 0, len(pages)) else ()):
            if not _is_int(ix):
                raise ManifestError(f"{where}.page_ixs[{j}]", "must be an integer")
            if not 0 <= ix < len(pages):
                raise ManifestError(f"{where}.page_ixs[{j}]",
                                    f"{ix} is out of range (the manifest lists {len(pages)} pages)")
        fill = s.get("fill_in_last_page", 0)
        if not _is_int(fill) or not 0 <= fill < P:
            raise ManifestError(f"{where}.fill_in_last_page", f"must be an integer in 0..{P - 1}")
        if not ixs and fill:
            raise ManifestError(f"{where}.fill_in_last_page", "must be 0 for a sequence without pages")
        toks = s.get("token_ids")
        seq = LogicalSeq(sid, list(ixs), fill, None)
        if toks is not None:
            if not isinstance(toks, list):
                raise ManifestError(f"{where}.token_ids", "must be a list of integers")
            if len(toks) > MAX_TOKENS_PER_SEQ:
                raise ManifestError(f"{where}.token_ids", f"more than {MAX_TOKENS_PER_SEQ} tokens")
            for j, t in enumerate(toks if not _ints_within(toks, 0, None) else ()):
                if not _is_int(t) or t < 0:
                    raise ManifestError(f"{where}.token_ids[{j}]", "must be a non-negative integer")
            want = seq.n_tokens(P)
            if len(toks) != want:
                raise ManifestError(f"{where}.token_ids",
                                    f"holds {len(toks)} tokens, the pages hold {want}")
            seq.token_ids = list(toks)
        seqs.append(seq)

    for key in ("model", "kv", "engine"):
        v = d.get(key)
        if v is not None and not isinstance(v, dict):
            raise ManifestError(key, "must be an object or null")
    kv = d.get("kv")
    if kv is not None and "k_has_rope" in kv and not isinstance(kv["k_has_rope"], bool):
        raise ManifestError("kv.k_has_rope", "must be true or false")
    return pages, seqs


def parse(data: bytes | str) -> Manifest:
    """Parse and validate manifest bytes (ManifestError on any violation)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError("manifest", f"{len(data)} bytes exceed the {MAX_MANIFEST_BYTES}-byte cap")
    try:
        d = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ManifestError("manifest", f"not valid JSON: {e}") from None
    pages, seqs = _check(d)
    known = {"attention", "layout", "page_size_tokens", "n_layers", "n_heads", "head_dim", "dtype",
             "pages", "page_table", "logical_seqs", "model", "kv", "engine"}
    return Manifest(
        page_size_tokens=d["page_size_tokens"], n_layers=d["n_layers"], n_heads=d["n_heads"],
        head_dim=d["head_dim"], dtype=d["dtype"], pages=pages, logical_seqs=seqs,
        layout=d.get("layout", DEFAULT_LAYOUT), model=d.get("model"), kv=d.get("kv"),
        engine=d.get("engine"), extra={k: v for k, v in d.items() if k not in known},
        attention=d.get("attention", "mha"))
