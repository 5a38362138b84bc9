"""The S3 client of an S3 store, and how its requests fail: timeouts, retries, outages.

An unreachable or refusing endpoint raises :class:`~pffs.errors.StoreUnavailable`
(EIO to a FUSE caller) after a short timeout and few retries; after a
request found the endpoint silent, requests fail at once for ``DOWN_HOLD``
seconds.  boto3 is imported on first use, so local stores never need it.
"""

from __future__ import annotations

import http.client
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pffs.errors import PffsError, StoreUnavailable
from pffs.store.s3lean import Answer, LeanS3

DOWN_HOLD = 1.0


class S3Requests:
    """The client, the upload pool and the request plumbing of :class:`~pffs.store.s3.S3BlobStore`.

    A mixin: the store's ``__init__`` sets the options and state it uses
    (``timeout``, ``retries``, ``threads``, credentials, ``_client``,
    ``_pool``, ``_down_until``, ``_last_answer``, ``_began``…).
    """

    # Set by the store's __init__.
    url: str
    bucket: str
    endpoint: str | None
    region: str | None
    access_key: str | None
    secret_key: str | None
    addressing: str
    timeout: float
    retries: int
    threads: int
    _client: Any  # a boto3 S3 client (boto3 has no type information)
    _lean: LeanS3 | None
    _client_lock: threading.Lock
    _pool: ThreadPoolExecutor | None
    _down_until: float
    _down_reason: str
    _last_answer: float
    _began: threading.local

    @property
    def client(self):
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = self._make_client()
        return self._client

    def _make_client(self):
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise PffsError("S3 stores need boto3: pip install 'pffs[s3]'") from None
        kw = dict(connect_timeout=self.timeout, read_timeout=self.timeout,
                  retries={"total_max_attempts": self.retries, "mode": "standard"},
                  max_pool_connections=2 * self.threads + 8, s3={"addressing_style": self.addressing},
                  signature_version="s3v4")
        try:
            # sha256 of every blob is checked on read; spare the extra CRCs.
            config = Config(**kw, request_checksum_calculation="when_required",
                            response_checksum_validation="when_required")
        except TypeError:
            config = Config(**kw)
        session = boto3.session.Session(aws_access_key_id=self.access_key,
                                        aws_secret_access_key=self.secret_key,
                                        region_name=self.region)
        if session.region_name is None:
            session = boto3.session.Session(aws_access_key_id=self.access_key,
                                            aws_secret_access_key=self.secret_key,
                                            region_name="us-east-1")
        client = session.client("s3", endpoint_url=self.endpoint, config=config)
        client.meta.events.register("response-received.s3", self._on_response)
        self._lean = LeanS3(client, session.get_credentials(), self.bucket, self.addressing, self.timeout)
        return client

    @property
    def lean(self) -> LeanS3:
        """The lean path of single-object requests (pffs.store.s3lean)."""
        if self._lean is None:
            _ = self.client     # (made with it: one endpoint, region and credentials)
        assert self._lean is not None
        return self._lean

    def _send(self, method: str, key: str, what: str, *, body: bytes = b"",
              headers: dict[str, str] | None = None, hold: bool = True) -> Answer:
        """One request on the lean path: its answer, whatever the status (the
        caller reads it), after up to ``retries`` attempts where the network
        failed or the server asked to be tried again (5xx), as boto3's
        "standard" mode does; StoreUnavailable where no answer came, a timeout
        that nothing answered since it began holding the endpoint (unless not
        *hold*), as in :meth:`_error`."""
        self._check_up(what)
        lean = self.lean
        for attempt in range(self.retries):
            last = attempt == self.retries - 1
            try:
                a = lean.send(method, key, body=body, headers=headers)
            except (OSError, http.client.HTTPException) as e:
                if not last:
                    self._back_off(attempt)
                    continue
                timeout = isinstance(e, TimeoutError)
                if timeout:
                    why = f"timeout: no answer in {self.timeout:g} s"
                elif isinstance(e, OSError) and e.strerror:
                    why = f"no connection to the endpoint: {e.strerror}"
                else:
                    why = str(e) or type(e).__name__
                if hold and timeout:
                    self._hold_if_silent(why)
                raise StoreUnavailable(f"{self.url}: {what}: {why}") from None
            self._last_answer = time.monotonic()
            self._down_until = 0.0
            if a.status < 500 or last:
                return a
            self._back_off(attempt)
        raise AssertionError("unreachable")

    @staticmethod
    def _back_off(attempt: int) -> None:
        time.sleep(random.uniform(0, 0.05 * 2 ** attempt))

    def _refused(self, what: str, a: Answer) -> StoreUnavailable:
        """The StoreUnavailable for an error answer *a* (worded as :meth:`_error`'s)."""
        return StoreUnavailable(f"{self.url}: {what}: {_refusal(a.code, a.status)}")

    def _hold_if_silent(self, why: str) -> None:
        """After a timeout: fail requests at once for DOWN_HOLD seconds, unless
        the endpoint answered something since this thread's request began."""
        if self._last_answer <= getattr(self._began, "t", 0.0):
            self._down_reason = f"no answer a moment ago ({why})"
            self._down_until = time.monotonic() + DOWN_HOLD

    def _get_body(self, key: str, what: str) -> Answer | None:
        """GET *key* on the lean path: its answer, None where there is no such key."""
        a = self._send("GET", key, what)
        if a.status in (200, 206):
            return a
        if a.status == 404 and a.code != "NoSuchBucket":
            return None
        raise self._refused(what, a)

    def _on_response(self, response_dict=None, **kw) -> None:
        if response_dict is not None:  # the endpoint answered (any status)
            self._last_answer = time.monotonic()
            self._down_until = 0.0

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            with self._client_lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=self.threads,
                                                    thread_name_prefix="pffs-s3")
        return self._pool

    def _check_up(self, what: str) -> None:
        """Fail at once while the endpoint is held silent; else note when this request began."""
        self._began.t = now = time.monotonic()
        if now < self._down_until:
            raise StoreUnavailable(f"{self.url}: {what}: {self._down_reason}")

    def _call(self, op: str, what: str, **kw):
        """One S3 request; None for "no such key", StoreUnavailable for everything the network did."""
        from botocore.exceptions import BotoCoreError, ClientError
        self._check_up(what)
        try:
            return getattr(self.client, op)(Bucket=self.bucket, **kw)
        except ClientError as e:
            if http_status(e) == 404 and _code(e) not in ("NoSuchBucket",):
                return None
            raise self._error(what, e) from None
        except (BotoCoreError, OSError) as e:
            raise self._error(what, e) from None

    def _error(self, what: str, e: Exception, *, hold: bool = True) -> StoreUnavailable:
        """The StoreUnavailable for a failed request; a timeout of one that
        nothing answered since it began holds the endpoint (unless not *hold*)."""
        from botocore.exceptions import ClientError
        if isinstance(e, ClientError):
            why = _refusal(_code(e), http_status(e))
        else:
            from botocore.exceptions import ConnectTimeoutError, ReadTimeoutError
            why = str(e) or type(e).__name__
            if hold and isinstance(e, (ConnectTimeoutError, ReadTimeoutError)):
                # Refused connections fail fast by themselves; only timeouts hold.
                self._hold_if_silent(why)
        return StoreUnavailable(f"{self.url}: {what}: {why}")


def _refusal(code: str, status: int) -> str:
    """Why the server refused a request, from its S3 error code and HTTP status."""
    if code == "NoSuchBucket":
        return "the bucket does not exist"
    if status == 403:
        return f"access denied ({code or 'Forbidden'})"
    return f"{code or 'error'} (HTTP {status})"


def http_status(e) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _code(e) -> str:
    return str(e.response.get("Error", {}).get("Code") or "")
