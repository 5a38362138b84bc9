"""Where an S3 store lives: its URL, its layout in the bucket, and the cache folder bound to it.

``pffs mount --store s3://BUCKET/PREFIX`` keeps, under ``PREFIX/``::

    blobs/<2 hex>/<64 hex>   one frame per blob, named by the sha256 of its raw bytes
    trash/<2 hex>/<64 hex>   blobs gc has set aside (read back and restored if still needed)
    manifests/<NAME>         manifests published with ``pffs push`` (the user's bytes)
    mounts/<ID>              registrations of the stores using the bucket (pffs.bucket.transfer)

Each mount keeps its namespace in a local folder (the *cache folder*); the
folder's ``remote.json`` binds it to one URL, so every tool given the folder
finds the bucket.  Nothing here needs boto3.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from pffs.errors import PffsError

SCHEME = "s3://"
CONFIG_NAME = "remote.json"
BLOBS = "blobs/"
TRASH = "trash/"
MANIFESTS = "manifests/"
MOUNTS = "mounts/"

# Mount options (``-o``) that configure the S3 client; ``lease`` is pffs.bucket.transfer's.
OPTIONS = ("endpoint", "region", "access_key", "secret_key", "addressing", "s3_timeout",
           "s3_retries", "upload_threads", "lease")
# Options worth remembering in remote.json for later tools (never secrets).
PERSISTED = ("endpoint", "region", "addressing")
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]\Z")


# -- URLs and the cache folder ------------------------------------------------

def url_of(value) -> str | None:
    """The normalised ``s3://bucket/prefix`` if *value* is an S3 URL, else None."""
    if value is None or not str(value).startswith(SCHEME):
        return None
    bucket, prefix = parse_url(str(value))
    return f"{SCHEME}{bucket}/{prefix.rstrip('/')}" if prefix else f"{SCHEME}{bucket}"


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` → ('bucket', 'a/b/'); the prefix is '' or ends in '/'."""
    rest = url[len(SCHEME):]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_RE.match(bucket):
        raise PffsError(f"{url}: bad bucket name {bucket!r} (3-63 lowercase letters, digits, '.', '-')")
    parts = [p for p in prefix.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise PffsError(f"{url}: '.' and '..' are not allowed in the prefix")
    return bucket, "".join(p + "/" for p in parts)


def is_remote(store) -> bool:
    """Whether a --store value names an S3 store: its URL, or a cache folder bound to one."""
    if store is None:
        return False
    return url_of(store) is not None or (Path(store) / CONFIG_NAME).exists()


def default_cache_dir(url: str) -> Path:
    """``$XDG_CACHE_HOME/pffs/<bucket>-<prefix>-<hash>`` (or ~/.cache/pffs/…), one per URL."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    bucket, prefix = parse_url(url)
    label = re.sub(r"[^A-Za-z0-9.\-]+", "-", f"{bucket}-{prefix}").strip("-")[:80]
    return Path(base) / "pffs" / f"{label}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def read_config(root: Path) -> dict | None:
    try:
        with open(root / CONFIG_NAME) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise PffsError(f"{root / CONFIG_NAME}: unreadable ({e})") from None
    if not isinstance(cfg, dict) or url_of(cfg.get("url")) is None:
        raise PffsError(f"{root / CONFIG_NAME}: no s3:// url in it")
    return cfg


def bind(root: Path, url: str, options: dict) -> dict:
    """Bind the cache folder *root* to *url* (remote.json); refuse a folder bound elsewhere."""
    cfg = read_config(root)
    if cfg is not None and url_of(cfg["url"]) != url:
        raise PffsError(f"{root} is the cache folder of {cfg['url']}, not of {url}")
    if cfg is None and (root / "namespace.db").exists():
        raise PffsError(f"{root} holds a local pffs store; give S3 stores a folder of their own (--cache)")
    new = dict(cfg or {})
    new["url"] = url
    new.update({k: options[k] for k in PERSISTED if options.get(k)})
    if new != cfg:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{CONFIG_NAME}.{os.getpid()}"
        tmp.write_text(json.dumps(new, indent=2) + "\n")
        os.replace(tmp, root / CONFIG_NAME)
    return new
