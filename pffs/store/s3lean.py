"""The lean path of an S3 store's hot requests: GET, PUT and HEAD of one object.

A boto3 call builds its request through botocore's whole machinery (operation
models, parameter validation, event hooks, response parsing): measured on a
2-core host, about 3.5 ms of CPU a request whatever its size, more than the
decode and sha256 of the 2 MiB page it fetches (docs/s3.md, "Requests").
The requests a page costs (a blob's GET and PUT, the shared index's small
GETs and PUTs, a HEAD before an upload) go this way instead: signed by
botocore's own SigV4 signer (``S3SigV4Auth``; the payload unsigned, as over
TLS: every blob names its sha256, which reads check), sent on a keep-alive
connection of the calling thread (the standard library's http.client), the
body read straight into one buffer of its length.  Listing, deleting,
copying and anything else stays on the boto3 client.

:class:`LeanS3` only sends and answers: statuses, errors, retries and the
endpoint's hold are the store's (pffs.store.s3client).
"""

from __future__ import annotations

import http.client
import os
import re
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

_CODE = re.compile(rb"<Code>([^<]{1,100})</Code>")
_DNS_LABEL = re.compile(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]")


@dataclass
class Answer:
    """An HTTP answer: its status, headers (names lower case) and body."""
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def code(self) -> str:
        """The S3 error code of an error answer's XML body ("" where none)."""
        m = _CODE.search(self.body[:4096])
        return m.group(1).decode("ascii", "replace") if m else ""

    def metadata(self) -> dict[str, str]:
        """The object's user metadata (``x-amz-meta-*``), names lower case."""
        return {k[11:]: v for k, v in self.headers.items() if k.startswith("x-amz-meta-")}


class LeanS3:
    """Signed single-object requests to one bucket, beside a boto3 *client*
    whose endpoint, region and credentials they share."""

    def __init__(self, client: Any, credentials: Any, bucket: str, addressing: str, timeout: float):
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        class Signer(S3SigV4Auth):
            def _should_sha256_sign_payload(self, request):
                return False    # UNSIGNED-PAYLOAD (a blob's bytes name their sha256)

        self._Signer = Signer
        self._Request = AWSRequest
        self._credentials = credentials
        self._region = client.meta.region_name or "us-east-1"
        parts = urlsplit(client.meta.endpoint_url)
        self._https = parts.scheme == "https"
        if addressing == "path" or not _DNS_LABEL.fullmatch(bucket):
            self._host = parts.netloc
            self._path = f"/{quote(bucket, safe='')}/"
        else:   # virtual-hosted, as botocore addresses a bucket named as a DNS label
            self._host = f"{bucket}.{parts.netloc}"
            self._path = "/"
        self._origin = f"{parts.scheme}://{self._host}"
        self._timeout = timeout
        self._ssl: Any = None
        if self._https:
            import ssl

            from botocore.httpsession import get_cert_path
            self._ssl = ssl.create_default_context(cafile=get_cert_path(True))
        self._local = threading.local()
        self._lock = threading.Lock()
        self.requests = 0       # sent (tests count them)

    def url(self, key: str) -> str:
        return self._origin + self._path + quote(key, safe="/~")

    def _kept(self) -> http.client.HTTPConnection | None:
        """This thread's kept-alive connection, if it opened one (in this
        process: one inherited across a fork is the parent's, never used)."""
        if getattr(self._local, "pid", None) != os.getpid():
            self._local.conn = None
        return getattr(self._local, "conn", None)

    def _connection(self) -> http.client.HTTPConnection:
        c = self._kept()
        if c is None:
            if self._https:
                c = http.client.HTTPSConnection(self._host, timeout=self._timeout, context=self._ssl)
            else:
                c = http.client.HTTPConnection(self._host, timeout=self._timeout)
            self._local.conn, self._local.pid = c, os.getpid()
        return c

    def _drop(self) -> None:
        c = self._kept()
        self._local.conn = None
        if c is not None:
            c.close()

    def send(self, method: str, key: str, *, body: bytes = b"",
             headers: dict[str, str] | None = None) -> Answer:
        """One signed request for object *key*: its answer, whatever the status;
        OSError (a timeout, a refused connection) or http.client's error where
        none came.  A kept-alive connection the server closed meanwhile is
        opened again once, for the same request."""
        url = self.url(key)
        sent = dict(headers or {})
        if self._credentials is not None:     # (else anonymous: a public bucket)
            req = self._Request(method=method, url=url, headers=sent)     # (the payload is not signed)
            self._Signer(self._credentials.get_frozen_credentials(), "s3", self._region).add_auth(req)
            sent = dict(req.headers.items())
        target = url[len(self._origin):]
        with self._lock:
            self.requests += 1
        for again in (True, False):
            reused = self._kept() is not None
            conn = self._connection()
            try:
                conn.request(method, target, body=body or None, headers=sent)
                r = conn.getresponse()
                data = r.read()      # (its length given: one buffer, read into; a short body raises)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self._drop()
                if again and reused:
                    continue
                raise
            except BaseException:
                self._drop()
                raise
            if r.will_close:
                self._drop()
            return Answer(r.status, {k.lower(): v for k, v in r.getheaders()}, data)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._drop()
