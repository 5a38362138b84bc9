"""Where bytes are compressed: self-describing blob frames.

A frame is a 20-byte header, then (a named frame) its name, then the payload::

    offset size  field
    0      4     magic b"PFB1"
    4      1     codec id (0 raw, 1 zstd, 2 planes-zstd)
    5      1     codec parameter (zstd level, signed)
    6      2     flags (planes-zstd: which planes are zstd frames; NAMED)
    8      8     raw length (little endian)
    16     4     crc32 of the raw bytes (little endian)
    20     32    with the NAMED flag: the sha256 of the raw bytes (the blob's name)

Every frame names its codec, so blobs written under an old default stay
readable.  ``planes-zstdN`` splits 16-bit values into a low-byte plane and a
high-byte plane before zstd: the high bytes of bf16/f16 KV (sign, exponent)
compress far better on their own.  Its payload is, for the low plane then
the high plane, a u32 length and the plane (a zstd frame when the matching
flag bit is set, else the plane raw), then the odd tail byte if any.  A frame
that compresses by less than ``MIN_GAIN`` is stored raw.

A *named* frame (written by :func:`seal` since the NAMED flag exists)
carries the sha256 its bytes were stored under, so a reader can tell that
the frame at a name is that name's blob without hashing it again: the name
in the frame must be the one asked for and the crc32 of the decoded bytes
must match (docs/format.md, "What a read checks").

Decoding trusts nothing: the raw length must not exceed the caller's limit,
a zstd frame may not declare or produce more than the raw length
(decompression bombs), and the crc32 must match.  All heavy work (zstd,
numpy copies, crc32) releases the GIL, so callers run it in worker threads.
"""

from __future__ import annotations

import hashlib
import re
import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import zstandard

from pffs.errors import CodecError

if TYPE_CHECKING:
    from concurrent.futures import Executor

try:
    # The same checksum as zlib's, computed with the CPU's carry-less multiply:
    # about ten times zlib's speed (a 2 MiB page: 0.04 ms against 0.4-1 ms).
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency; still correct without it
    from zlib import crc32

MAGIC = b"PFB1"
HEADER = struct.Struct("<4sBbHQI")
HEADER_SIZE = HEADER.size  # 20
assert HEADER_SIZE == 20

CODEC_RAW = 0
CODEC_ZSTD = 1
CODEC_PLANES_ZSTD = 2

DEFAULT_CODEC = "planes-zstd1"
# A compressed frame must save at least this fraction, else raw is stored.
MIN_GAIN = 0.05
# Largest raw length a frame may declare (a blob holds at most one block).
MAX_RAW = 256 << 20

_NAME_RE = re.compile(r"(raw)|zstd-(-?\d+)|planes-zstd(-?\d+)\Z")


@dataclass(frozen=True)
class Codec:
    """A codec choice: id plus zstd level."""

    id: int
    level: int = 0

    @property
    def name(self) -> str:
        if self.id == CODEC_RAW:
            return "raw"
        if self.id == CODEC_ZSTD:
            return f"zstd-{self.level}"
        return f"planes-zstd{self.level}"


def parse_codec(name: str) -> Codec:
    """``raw``, ``zstd-N`` or ``planes-zstdN`` → Codec (ValueError otherwise)."""
    m = _NAME_RE.fullmatch(name)
    if not m:
        raise ValueError(f"unknown codec {name!r} (use raw, zstd-N or planes-zstdN)")
    if m.group(1):
        return Codec(CODEC_RAW)
    kind = CODEC_ZSTD if m.group(2) is not None else CODEC_PLANES_ZSTD
    level = int(m.group(2) if m.group(2) is not None else m.group(3))
    if not -7 <= level <= 22 or level == 0:
        raise ValueError(f"codec {name!r}: zstd level must be 1..22 or -7..-1")
    return Codec(kind, level)


def for_itemsize(codec: Codec, itemsize: int) -> Codec:
    """*codec* for values of *itemsize* bytes: ``planes-zstdN`` splits 16-bit
    values, which 1-byte values (fp8 pages) are not, so they take ``zstd-N``
    (the same ratio on real fp8 KV, 16-20% faster both ways: docs/performance.md)."""
    if codec.id == CODEC_PLANES_ZSTD and itemsize == 1:
        return Codec(CODEC_ZSTD, codec.level)
    return codec


@dataclass(frozen=True)
class FrameHeader:
    codec: Codec
    flags: int
    raw_len: int
    crc32: int

    @property
    def named(self) -> bool:
        """Whether the frame holds the sha256 of its bytes (after the header)."""
        return bool(self.flags & FLAG_NAMED)

    @property
    def payload_at(self) -> int:
        """Where the payload starts in the frame."""
        return HEADER_SIZE + NAME_SIZE if self.named else HEADER_SIZE


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # zstd contexts are not safe for concurrent use: one per thread and level.
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def _plane_params(level: int):
    # Level 1 on a byte plane: zstd's fast strategy with a tiny match table.
    # Exponent planes are mostly a Huffman job; fewer match probes are 3x
    # faster and compress as well or better than the stock level-1 table.
    if level != 1:
        return None
    return zstandard.ZstdCompressionParameters(
        window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7,
        target_length=0, strategy=zstandard.STRATEGY_FAST, write_content_size=True)


def _plane_compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "pctx", None)
    if cache is None:
        cache = _local.pctx = {}
    c = cache.get(level)
    if c is None:
        params = _plane_params(level)
        c = cache[level] = (zstandard.ZstdCompressor(compression_params=params)
                            if params else zstandard.ZstdCompressor(level=level))
    return c


# Planes are split SPLIT_STEP values (u16) at a time through a temporary that
# stays in the CPU's cache. One pass over a whole page wrote a temporary of
# twice its plane's size, whose pages the kernel maps and zeroes each time
# where buffers that large are mapped (the daemon's 64 MiB blocks): a 2 MiB
# page's planes split at 3.3 GB/s this way against 2.0 GB/s so, a 64 MiB
# block's at 4.2 against 1.0-2.2 GB/s.
SPLIT_STEP = 128 << 10


def split_planes(data) -> tuple[np.ndarray, np.ndarray, bytes]:
    """(low bytes, high bytes, odd tail byte) of the 16-bit little-endian values in *data*
    (the planes as contiguous uint8 arrays, never copied into bytes)."""
    a = np.frombuffer(data, dtype=np.uint8)
    n = len(a) & ~1
    w = a[:n].view("<u2")
    m = len(w)
    lo, hi = np.empty(m, np.uint8), np.empty(m, np.uint8)
    tmp = np.empty(min(m, SPLIT_STEP), "<u2")
    for at in range(0, m, SPLIT_STEP):
        part = w[at:at + SPLIT_STEP]
        t = tmp[:len(part)]
        np.copyto(lo[at:at + SPLIT_STEP], part, casting="unsafe")   # (the cast keeps the low byte)
        np.right_shift(part, 8, out=t)
        np.copyto(hi[at:at + SPLIT_STEP], t, casting="unsafe")
    return lo, hi, a[n:].tobytes()


def join_planes(lo, hi, tail) -> bytes:
    """Inverse of :func:`split_planes`."""
    w = np.frombuffer(hi, dtype=np.uint8).astype("<u2")
    w <<= 8
    w |= np.frombuffer(lo, dtype=np.uint8)
    return w.tobytes() + bytes(tail) if len(tail) else w.tobytes()


_PLANE_LEN = struct.Struct("<I")
# Flag bits of a planes-zstd frame: which plane payloads are zstd frames.
FLAG_LO_ZSTD = 1
FLAG_HI_ZSTD = 2
# Any codec: the sha256 of the raw bytes follows the header (NAME_SIZE bytes).
FLAG_NAMED = 0x8000
NAME_SIZE = 32
# The longest header a reader of the name needs (pffs.store's dedup checks).
NAMED_HEADER_SIZE = HEADER_SIZE + NAME_SIZE


# The low plane (the low mantissa bits of bf16 and f16 values) seldom
# compresses: one of LO_PROBE_FROM bytes or more is first tried on LO_PROBES
# samples of LO_PROBE bytes spread over it, and stored as it is when none
# gains MIN_GAIN, without compressing it all (a 2 MiB page of real bf16 KV:
# 0.36 ms of zstd saved for 0.05 ms of samples; docs/performance.md).  A plane
# with a compressible part (zeros past a page's used tokens, values of few
# mantissa bits) has it in some sample and is compressed whole.
LO_PROBE_FROM = 256 << 10
LO_PROBE = 32 << 10
LO_PROBES = 4


def _samples(n: int, size: int, count: int) -> range:
    """Offsets of *count* samples of *size* bytes spread over *n* bytes (n >= size * count)."""
    return range(0, n - size + 1, n // count)


def _plane_gains(plane: np.ndarray, level: int) -> bool:
    c = _plane_compressor(level)
    return any(len(c.compress(plane[at:at + LO_PROBE].data)) <= LO_PROBE * (1 - MIN_GAIN)
               for at in _samples(len(plane), LO_PROBE, LO_PROBES))


def _plane_payload(plane: np.ndarray, level: int, bit: int,
                   probe: bool = False) -> tuple[int, np.ndarray | bytes]:
    """(flag bit when zstd, payload) of one plane: its zstd frame, or the plane
    itself when that is not smaller (*probe*: or when no sample of a large
    plane gains)."""
    if probe and len(plane) >= LO_PROBE_FROM and not _plane_gains(plane, level):
        return 0, plane
    z = _plane_compressor(level).compress(plane.data)
    return (bit, z) if len(z) < len(plane) else (0, plane)


def _encode_planes(raw, level: int, pool: Executor | None = None) -> tuple[int, list]:
    """(flags, payload parts): the frame's payload is their concatenation.
    With *pool*, the high plane is compressed on it while this thread does the
    low one (zstd releases the GIL)."""
    lo, hi, tail = split_planes(raw)
    fut = pool.submit(_plane_payload, hi, level, FLAG_HI_ZSTD) if pool is not None else None
    lo_bit, lo_payload = _plane_payload(lo, level, FLAG_LO_ZSTD, probe=True)
    hi_bit, hi_payload = fut.result() if fut is not None else _plane_payload(hi, level, FLAG_HI_ZSTD)
    return lo_bit | hi_bit, [_PLANE_LEN.pack(len(lo_payload)), lo_payload,
                             _PLANE_LEN.pack(len(hi_payload)), hi_payload, tail]


def _zstd_decode(payload, size: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as e:
        raise CodecError(f"bad zstd frame: {e}") from None
    if declared != size:
        # -1 (unknown) is refused too: every frame pffs writes declares it.
        raise CodecError(f"zstd frame declares {declared} bytes, expected {size}")
    try:
        out = _decompressor().decompress(payload, max_output_size=size)
    except zstandard.ZstdError as e:
        raise CodecError(f"zstd: {e}") from None
    if len(out) != size:
        raise CodecError(f"zstd frame gave {len(out)} bytes, expected {size}")
    return out


def _decode_planes(payload: memoryview, flags: int, raw_len: int) -> bytes:
    return join_planes(*_plane_parts(payload, flags, raw_len))


def _plane_parts(payload: memoryview, flags: int, raw_len: int) -> tuple:
    """(low plane, high plane, tail) of a planes-zstd frame's payload, decompressed."""
    half = raw_len // 2
    pos = 0
    planes: list[bytes | memoryview] = []
    for bit in (FLAG_LO_ZSTD, FLAG_HI_ZSTD):
        if pos + 4 > len(payload):
            raise CodecError("planes frame truncated")
        (n,) = _PLANE_LEN.unpack_from(payload, pos)
        pos += 4
        part = payload[pos:pos + n]
        if len(part) != n:
            raise CodecError("planes frame truncated")
        pos += n
        if flags & bit:
            planes.append(_zstd_decode(part, half))
        elif n != half:
            raise CodecError(f"raw plane holds {n} bytes, expected {half}")
        else:
            planes.append(part)
    tail = payload[pos:]
    if len(tail) != raw_len - 2 * half:
        raise CodecError("planes frame has a wrong tail length")
    return planes[0], planes[1], tail


# A block of PROBE_FROM bytes or more is first tried on PROBES samples of PROBE
# bytes spread over it: when none gains, it is stored raw without compressing
# it all (the encode of random bytes, on each of them, costs 4x the hash).
PROBE_FROM = 8 << 20
PARALLEL_FROM = 8 << 20
PROBE = 256 << 10
PROBES = 4
_RAW = Codec(CODEC_RAW)


def _gains(head, codec: Codec) -> bool:
    if codec.id == CODEC_PLANES_ZSTD:
        _, parts = _encode_planes(head, codec.level)
    else:
        parts = [_compressor(codec.level).compress(head)]
    return sum(memoryview(p).nbytes for p in parts) <= len(head) * (1 - MIN_GAIN)


@dataclass(frozen=True)
class Encoded:
    """A block's frame before its name is known: header fields and payload parts
    (:func:`encode_parts`; :func:`seal` makes the frame)."""

    codec: Codec
    flags: int
    raw_len: int
    crc32: int
    parts: tuple


def encode_parts(data, codec: Codec | str = DEFAULT_CODEC, pool: Executor | None = None) -> Encoded:
    """Compress *data* with *codec* (raw when the gain is < 5 %) into an :class:`Encoded`.

    *pool*: helper threads for a large block (PARALLEL_FROM bytes or more):
    its two planes are compressed at once, the high one on *pool* (the same
    frame, in about half the time on two cores: docs/performance.md).
    """
    if isinstance(codec, str):
        codec = parse_codec(codec)
    raw = memoryview(data).cast("B")
    n = len(raw)
    if n > MAX_RAW:
        raise CodecError(f"blob of {n} bytes exceeds the {MAX_RAW}-byte frame limit")
    crc = crc32(raw)
    if codec.id != CODEC_RAW and n >= PROBE_FROM and not any(
            _gains(raw[at:at + PROBE], codec) for at in _samples(n, PROBE, PROBES)):
        codec = _RAW     # (a large block of which no sample compresses: random bytes)
    if codec.id != CODEC_RAW and n:
        flags = 0
        if codec.id == CODEC_PLANES_ZSTD:
            flags, parts = _encode_planes(raw, codec.level, pool if n >= PARALLEL_FROM else None)
        else:
            parts = [_compressor(codec.level).compress(raw)]
        if sum(memoryview(p).nbytes for p in parts) <= n * (1 - MIN_GAIN):
            return Encoded(codec, flags, n, crc, tuple(parts))
    return Encoded(_RAW, 0, n, crc, (raw,))


def seal(enc: Encoded, name: bytes | None = None) -> bytes:
    """The frame of *enc*; named by *name* (the 32-byte sha256 of its raw bytes)
    when given.  The one copy of the payload a frame costs is made here."""
    flags = enc.flags
    head = []
    if name is not None:
        if len(name) != NAME_SIZE:
            raise ValueError(f"a frame's name is {NAME_SIZE} bytes, not {len(name)}")
        flags |= FLAG_NAMED
        head.append(name)
    return b"".join([HEADER.pack(MAGIC, enc.codec.id, enc.codec.level, flags, enc.raw_len, enc.crc32),
                     *head, *enc.parts])


def encode(data, codec: Codec | str = DEFAULT_CODEC, pool: Executor | None = None,
           name: bytes | None = None) -> bytes:
    """Frame *data* with *codec* (:func:`encode_parts`, then :func:`seal` with *name*)."""
    return seal(encode_parts(data, codec, pool), name)


def read_header(frame) -> FrameHeader:
    """Parse and sanity-check a frame header (CodecError if malformed)."""
    if len(frame) < HEADER_SIZE:
        raise CodecError(f"frame of {len(frame)} bytes is shorter than its header")
    magic, cid, level, flags, raw_len, crc = HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise CodecError("bad frame magic")
    if cid not in (CODEC_RAW, CODEC_ZSTD, CODEC_PLANES_ZSTD):
        raise CodecError(f"unknown codec id {cid}")
    if flags & ~(FLAG_LO_ZSTD | FLAG_HI_ZSTD if cid == CODEC_PLANES_ZSTD else 0) & ~FLAG_NAMED:
        raise CodecError(f"unknown frame flags {flags:#x}")
    return FrameHeader(Codec(cid, level), flags, raw_len, crc)


def frame_name(frame) -> bytes | None:
    """The sha256 a named frame holds (None for a frame without one)."""
    hdr = read_header(frame)
    if not hdr.named:
        return None
    if len(frame) < hdr.payload_at:
        raise CodecError("named frame truncated in its name")
    return bytes(memoryview(frame)[HEADER_SIZE:hdr.payload_at])


def check_name(frame, name: bytes) -> bool:
    """Whether *frame* is named; CodecError if it names another blob than *name*."""
    got = frame_name(frame)
    if got is not None and got != name:
        raise CodecError("the frame stored under its name names another blob")
    return got is not None


def _payload(frame, hdr: FrameHeader) -> memoryview:
    if len(frame) < hdr.payload_at:
        raise CodecError("named frame truncated in its name")
    return memoryview(frame)[hdr.payload_at:]


def decode(frame, max_raw: int = MAX_RAW, *, check_crc: bool = True) -> bytes:
    """The raw bytes of *frame*, verified against its header.

    Raises CodecError for a malformed header, a declared length above
    *max_raw*, a zstd frame that would expand beyond the declared length,
    or a checksum mismatch.  *check_crc* may be turned off by a caller that
    verifies a stronger digest of the result anyway.
    """
    return _decode(frame, max_raw, check_crc, False)


def decode_view(frame, max_raw: int = MAX_RAW, *, check_crc: bool = True) -> bytes | memoryview:
    """:func:`decode`, but a planes frame's bytes are joined into an array of
    their own and handed back as a read-only memoryview, not copied into a
    bytes object (the daemon's reads: about 8% of a cold read's CPU, the copy
    and the fresh pages it wrote: docs/performance.md)."""
    return _decode(frame, max_raw, check_crc, True)


def _decode(frame, max_raw: int, check_crc: bool, view: bool) -> Any:
    hdr = read_header(frame)
    if hdr.raw_len > max_raw:
        raise CodecError(f"frame declares {hdr.raw_len} raw bytes, limit is {max_raw}")
    payload = _payload(frame, hdr)
    raw: bytes | memoryview
    if hdr.codec.id == CODEC_RAW:
        if len(payload) != hdr.raw_len:
            raise CodecError(f"raw frame holds {len(payload)} bytes, header says {hdr.raw_len}")
        raw = payload.toreadonly() if view else bytes(payload)
    elif hdr.codec.id == CODEC_ZSTD:
        raw = _zstd_decode(payload, hdr.raw_len)
    elif view and hdr.raw_len % 2 == 0:
        out = np.empty(hdr.raw_len, np.uint8)
        _join_into(out, *_plane_parts(payload, hdr.flags, hdr.raw_len)[:2])
        raw = out.data.toreadonly()
    else:
        raw = _decode_planes(payload, hdr.flags, hdr.raw_len)
    if check_crc and crc32(raw) != hdr.crc32:
        raise CodecError("crc32 of the decoded bytes does not match the header")
    return raw


def _join_into(dst, lo, hi) -> None:
    """The planes of an even number of bytes joined straight into *dst*: hi << 8 | lo."""
    w = np.frombuffer(dst, dtype="<u2")
    w[:] = np.frombuffer(hi, dtype=np.uint8)
    w <<= 8
    w |= np.frombuffer(lo, dtype=np.uint8)


def decode_into(frame, out, *, check_crc: bool = True) -> int:
    """Decode *frame* straight into *out* (a writable buffer); returns the raw length.

    When the frame's raw length is not ``len(out)`` nothing is written and
    that length is returned, so a caller can name the wrong size.  Same
    checks as :func:`decode`.
    """
    hdr = read_header(frame)
    dst = memoryview(out).cast("B")
    if hdr.raw_len != len(dst):
        return hdr.raw_len
    payload = _payload(frame, hdr)
    if hdr.codec.id == CODEC_PLANES_ZSTD and hdr.raw_len % 2 == 0:
        lo, hi, _ = _plane_parts(payload, hdr.flags, hdr.raw_len)
        _join_into(dst, lo, hi)
    else:
        dst[:] = decode(frame, max(hdr.raw_len, 1), check_crc=False)
    if check_crc and crc32(dst) != hdr.crc32:
        raise CodecError("crc32 of the decoded bytes does not match the header")
    return hdr.raw_len


def decode_into_checked(frame, out, name: bytes, *, rehash: bool = False) -> tuple[int, bool]:
    """:func:`decode_into`, and whether what it wrote is checked to be the blob
    *name* (a sha256): a named frame must name it (CodecError otherwise) and
    its crc32 is checked; an unnamed frame's bytes are not checked at all,
    for a caller that then hashes them.  *rehash* (``-o verify=sha256``):
    the sha256 of the bytes written must be *name*, named frame or not."""
    named = check_name(frame, name)
    if not rehash and not named:
        return decode_into(frame, out, check_crc=False), False
    dst = memoryview(out).cast("B")
    n = decode_into(frame, dst, check_crc=not rehash)
    if n != len(dst):
        return n, False
    if rehash and hashlib.sha256(dst).digest() != name:
        raise CodecError("sha256 of the stored bytes does not match its name")
    return n, True


def decode_into_runs(frame, runs: Sequence, name: bytes, *, rehash: bool = False) -> int:
    """Decode *frame* straight into *runs*, writable buffers whose lengths add up
    to its raw length, filled in order (a page whose memory is a few contiguous
    runs, as SGLang's host pool holds K and V: no staging copy); returns the raw
    length, nothing written where it is not theirs.  The bytes are checked to be
    blob *name* (a sha256), whatever the frame: a named frame must name it and
    its crc32 is checked, an unnamed one (or any, with *rehash*) is hashed;
    CodecError otherwise, the runs then holding what was decoded."""
    hdr = read_header(frame)
    views = [memoryview(r).cast("B") for r in runs]
    if hdr.raw_len != sum(len(v) for v in views):
        return hdr.raw_len
    named = check_name(frame, name)
    payload = _payload(frame, hdr)
    if hdr.codec.id == CODEC_PLANES_ZSTD and not any(len(v) % 2 for v in views):
        lo, hi, _ = _plane_parts(payload, hdr.flags, hdr.raw_len)
        lo, hi, at = memoryview(lo), memoryview(hi), 0
        for v in views:
            k = len(v) // 2
            _join_into(v, lo[at:at + k], hi[at:at + k])
            at += k
    else:
        raw = memoryview(decode(frame, max(hdr.raw_len, 1), check_crc=False))
        at = 0
        for v in views:
            v[:] = raw[at:at + len(v)]
            at += len(v)
    if rehash or not named:
        h = hashlib.sha256()
        for v in views:
            h.update(v)
        if h.digest() != name:
            raise CodecError("sha256 of the stored bytes does not match its name")
        return hdr.raw_len
    crc = 0
    for v in views:
        crc = crc32(v, crc)
    if crc != hdr.crc32:
        raise CodecError("crc32 of the decoded bytes does not match the header")
    return hdr.raw_len


def frame_extent(hdr: FrameHeader, pread: Callable[[int, int], bytes]) -> int | None:
    """The size in bytes a frame with header *hdr* must have, from its layout
    (``pread(n, offset)`` reads the frame), or None where its codec does not
    say without decoding (zstd-N: one zstd frame).  A planes-zstd frame costs
    two reads of 4 bytes: its planes' lengths.  So a truncated frame is found
    without reading its payload (``pffs check``, a frame a put would reuse)."""
    if hdr.codec.id == CODEC_RAW:
        return hdr.payload_at + hdr.raw_len
    if hdr.codec.id != CODEC_PLANES_ZSTD:
        return None
    at = hdr.payload_at
    for _ in range(2):
        got = pread(4, at)
        if len(got) < 4:
            return at + 4      # (shorter than that: truncated whatever the plane holds)
        at += 4 + _PLANE_LEN.unpack(got)[0]
    return at + (hdr.raw_len & 1)
