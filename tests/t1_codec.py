"""Level t1, units: no mount and no engine.
Codec: round trips, fallbacks, and refusal of malformed or hostile frames."""

from __future__ import annotations

import hashlib
import os
import struct
import zlib

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings, strategies as st

from pffs import codec
from pffs.errors import CodecError

CODECS = ["raw", "zstd-1", "zstd-3", "zstd-19", "zstd--3", "planes-zstd1", "planes-zstd3"]
NP_DTYPES = {"bf16": np.uint16, "f16": np.float16, "f32": np.float32,
             "fp8e4m3": np.uint8, "fp8e5m2": np.uint8}


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=20000), name=st.sampled_from(CODECS))
def test_roundtrip_arbitrary_bytes(data, name):
    frame = codec.encode(data, name)
    assert codec.decode(frame) == data
    assert codec.read_header(frame).raw_len == len(data)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(sorted(NP_DTYPES)), name=st.sampled_from(CODECS),
       shape=st.tuples(st.integers(1, 4), st.integers(1, 16), st.integers(1, 8)),
       seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1e-3, 1.0, 100.0]))
def test_roundtrip_tensors(dtype, name, shape, seed, scale):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * scale
    if dtype == "bf16":
        arr = (x.view(np.uint32) >> 16).astype(np.uint16)
    elif dtype in ("fp8e4m3", "fp8e5m2"):
        arr = rng.integers(0, 256, size=shape, dtype=np.uint8)
    else:
        arr = x.astype(NP_DTYPES[dtype])
    raw = arr.tobytes()
    assert codec.decode(codec.encode(raw, name)) == raw


def test_real_kv_compresses(bf16_pages, fp16_pages):
    for pages, floor in ((bf16_pages, 1.40), (fp16_pages, 1.10)):
        raw = sum(map(len, pages))
        stored = sum(len(codec.encode(p, "planes-zstd1")) for p in pages)
        assert raw / stored >= floor
        assert all(codec.decode(codec.encode(p)) == p for p in pages[:8])


def test_default_is_planes():
    assert codec.DEFAULT_CODEC == "planes-zstd1"
    frame = codec.encode(bytes(4096))
    assert codec.read_header(frame).codec.name == "planes-zstd1"


def test_incompressible_falls_back_to_raw():
    import os
    data = os.urandom(100_000)
    for name in CODECS:
        frame = codec.encode(data, name)
        assert codec.read_header(frame).codec.name == "raw"
        assert len(frame) == len(data) + codec.HEADER_SIZE


def test_parse_codec_names():
    assert codec.parse_codec("zstd-19").name == "zstd-19"
    assert codec.parse_codec("planes-zstd1").name == "planes-zstd1"
    for bad in ["zstd", "zstd-0", "zstd-99", "lz4", "planes", ""]:
        with pytest.raises(ValueError):
            codec.parse_codec(bad)


def _zstd_frame(raw_len_header: int, content: bytes, declare=True) -> bytes:
    c = zstandard.ZstdCompressor(level=1, write_content_size=declare)
    payload = c.compress(content)
    return codec.HEADER.pack(codec.MAGIC, codec.CODEC_ZSTD, 1, 0, raw_len_header,
                             zlib.crc32(content)) + payload


def test_bomb_declared_size_refused():
    # A frame that declares 1 GiB of output while the header claims 10 bytes.
    frame = _zstd_frame(10, bytes(1 << 20))
    with pytest.raises(CodecError, match="declares"):
        codec.decode(frame)


def test_bomb_undeclared_size_refused():
    frame = _zstd_frame(10, bytes(1 << 20), declare=False)
    with pytest.raises(CodecError):
        codec.decode(frame)


def test_huge_raw_length_refused():
    frame = codec.HEADER.pack(codec.MAGIC, codec.CODEC_RAW, 0, 0, 1 << 40, 0)
    with pytest.raises(CodecError, match="limit"):
        codec.decode(frame)
    frame = _zstd_frame(4096, bytes(4096))
    with pytest.raises(CodecError, match="limit"):
        codec.decode(frame, max_raw=1000)


def test_planes_bomb_refused():
    raw = bytes(8192)
    frame = bytearray(codec.encode(raw, "planes-zstd1"))
    # Rewrite the header to claim fewer bytes than the planes hold.
    struct.pack_into("<Q", frame, 8, 100)
    with pytest.raises(CodecError):
        codec.decode(bytes(frame))


@pytest.mark.parametrize("name", ["raw", "zstd-1", "planes-zstd1"])
def test_flipped_and_truncated_frames_refused(name, bf16_pages):
    frame = codec.encode(bf16_pages[3], name)
    for pos in (0, 5, 9, 17, codec.HEADER_SIZE + 10, len(frame) // 2, len(frame) - 1):
        bad = bytearray(frame)
        bad[pos] ^= 0x40
        try:
            out = codec.decode(bytes(bad))
        except CodecError:
            continue
        # A flip that still decodes must not yield different bytes unnoticed.
        assert out == bf16_pages[3], f"flip at {pos} returned wrong bytes"
    for cut in (3, codec.HEADER_SIZE, len(frame) - 1):
        with pytest.raises(CodecError):
            codec.decode(frame[:cut])


def test_a_large_random_block_is_stored_raw_and_a_partly_random_one_compressed():
    """Blocks of 8 MiB or more are sampled first: random bytes go raw without a
    whole compression; a block with any compressible sample is compressed."""
    rnd = np.random.default_rng(7).integers(0, 256, 16 << 20, dtype=np.uint8).tobytes()
    f = codec.encode(rnd)
    assert codec.read_header(f).codec.id == codec.CODEC_RAW and codec.decode(f) == rnd
    mixed = rnd[:1 << 20] + bytes(15 << 20)
    f = codec.encode(mixed)
    assert codec.read_header(f).codec.id == codec.CODEC_PLANES_ZSTD and len(f) < 2 << 20
    assert codec.decode(f) == mixed


def test_a_large_blocks_planes_on_two_threads_give_the_same_frame(bf16_pages):
    from concurrent.futures import ThreadPoolExecutor
    # A block past PARALLEL_FROM, of real KV values with an odd tail byte.
    block = b"".join(bf16_pages * (-(-codec.PARALLEL_FROM // sum(map(len, bf16_pages))) + 1))
    block = block[:codec.PARALLEL_FROM + 3]
    calls = []
    with ThreadPoolExecutor(1) as pool:
        orig = pool.submit

        def submit(fn, *a):
            calls.append(fn.__name__)
            return orig(fn, *a)
        pool.submit = submit    # type: ignore[method-assign]
        frame = codec.encode(block, "planes-zstd1", pool=pool)
        assert codec.encode(block[:-4096], "planes-zstd1", pool=pool)   # (under PARALLEL_FROM: no help)
    assert calls == ["_plane_payload"]
    assert frame == codec.encode(block, "planes-zstd1")
    assert codec.decode(frame) == block


@pytest.mark.parametrize("name", ["raw", "zstd-1", "planes-zstd1"])
def test_a_named_frame_holds_its_blobs_sha256(name, bf16_pages):
    page = bf16_pages[2]
    d = hashlib.sha256(page).digest()
    frame = codec.encode(page, name, name=d)
    plain = codec.encode(page, name)
    hdr = codec.read_header(frame)
    assert hdr.named and not codec.read_header(plain).named
    assert codec.frame_name(frame) == d and codec.frame_name(plain) is None
    assert len(frame) == len(plain) + codec.NAME_SIZE and hdr.payload_at == codec.NAMED_HEADER_SIZE
    assert codec.decode(frame) == page
    out = bytearray(len(page))
    assert codec.decode_into(frame, out) == len(page) and out == page
    # The same payload either way; a frame cut inside its name is refused.
    assert frame[codec.NAMED_HEADER_SIZE:] == plain[codec.HEADER_SIZE:]
    with pytest.raises(CodecError, match="name"):
        codec.frame_name(frame[:codec.HEADER_SIZE + 5])
    with pytest.raises(CodecError):
        codec.decode(frame[:codec.HEADER_SIZE + 5])
    with pytest.raises(ValueError):
        codec.encode(page, name, name=d[:16])
    # Encoded now, named later: the same frame.
    assert codec.seal(codec.encode_parts(page, name), d) == frame


def test_decode_view_gives_the_bytes_without_copying_them_into_bytes(bf16_pages):
    """decode_view: a planes frame's bytes joined into an array of their own, a
    raw frame's the frame's own, both as read-only views holding what decode
    gives; damaged frames refused the same way."""
    page = b"".join(bf16_pages)[:1 << 20]
    for frame in (codec.encode(page), codec.encode(os.urandom(1 << 16)), codec.encode(page[:1001])):
        got = codec.decode_view(frame)
        assert got == codec.decode(frame)
        assert len(got) == len(codec.decode(frame))
    planes = codec.decode_view(codec.encode(page))
    raw = codec.decode_view(codec.encode(os.urandom(1 << 16)))
    for view in (planes, raw):
        assert isinstance(view, memoryview) and view.readonly and view.format == "B"
    bad = bytearray(codec.encode(page))
    bad[-1] ^= 1
    with pytest.raises(CodecError):
        codec.decode_view(bytes(bad))


def test_one_byte_values_take_zstd_not_byte_planes():
    """planes-zstdN splits 16-bit values: fp8 pages (1-byte values) take zstd-N; other
    codecs, and wider values, stay as chosen."""
    planes = codec.parse_codec("planes-zstd1")
    assert codec.for_itemsize(planes, 1) == codec.parse_codec("zstd-1")
    assert codec.for_itemsize(planes, 2) == planes
    assert codec.for_itemsize(codec.parse_codec("zstd-19"), 1) == codec.parse_codec("zstd-19")


@pytest.mark.parametrize("name", ["raw", "zstd-1", "planes-zstd1"])
@pytest.mark.parametrize("cuts", [[], [1 << 19], [4096, 65536, 1 << 19], [1000], [1001]])
def test_a_frame_decodes_straight_into_runs_of_memory(name, cuts, bf16_pages):
    """decode_into_runs: a page whose memory is a few runs (SGLang's host pool:
    its K and its V) gets the bytes straight into them, in order, checked to be
    the blob named: a named frame by its crc32, an unnamed one (or any, with
    rehash) by its sha256; another blob's name, a flipped byte or another
    size refused."""
    page = b"".join(bf16_pages)[:1 << 20]
    d = hashlib.sha256(page).digest()
    edges = [0, *cuts, len(page)]
    for frame in (codec.encode(page, name, name=d), codec.encode(page, name)):
        for rehash in (False, True):
            runs = [np.zeros(b - a, np.uint8) for a, b in zip(edges, edges[1:])]
            assert codec.decode_into_runs(frame, runs, d, rehash=rehash) == len(page)
            assert b"".join(r.tobytes() for r in runs) == page
        with pytest.raises(CodecError):
            codec.decode_into_runs(frame, [np.zeros(len(page), np.uint8)], hashlib.sha256(b"x").digest())
    # Another size: nothing written, its size said.
    short = np.zeros(len(page) - 2, np.uint8)
    assert codec.decode_into_runs(codec.encode(page, name, name=d), [short], d) == len(page)
    assert not short.any()
    bad = bytearray(codec.encode(page, name, name=d))
    bad[len(bad) // 2] ^= 0x10
    with pytest.raises(CodecError):
        codec.decode_into_runs(bytes(bad), [np.zeros(len(page), np.uint8)], d)


def test_a_low_plane_no_sample_of_which_compresses_is_not_compressed_whole(bf16_pages, fp16_pages):
    """The low bytes of real bf16 KV do not compress: a large plane is tried on
    a few samples and stored as it is, so zstd sees the high plane and the
    samples only.  A page with zeros in it (unused token slots) or values of
    few mantissa bits still has its low plane compressed."""
    page = b"".join(bf16_pages)
    page = (page * (-(-(2 << 20) // len(page))))[:2 << 20]
    fed: list[int] = []
    orig = codec._plane_compressor

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def compress(self, data):
            fed.append(memoryview(data).nbytes)
            return self.inner.compress(data)

    def counting(level):
        return Counting(orig(level))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(codec, "_plane_compressor", counting)
        frame = codec.encode(page, "planes-zstd1")
        assert not codec.read_header(frame).flags & codec.FLAG_LO_ZSTD
        assert codec.read_header(frame).flags & codec.FLAG_HI_ZSTD
        # The high plane whole (1 MiB) and the low plane's samples, never the low plane whole.
        assert sum(fed) <= (1 << 20) + codec.LO_PROBES * codec.LO_PROBE
        assert codec.decode(frame) == page
        a = np.frombuffer(page, "<u2").copy()
        zeros = a.copy()
        for at in range(0, len(a), 16 << 10):      # (a tenth of every 32 KiB run unused)
            zeros[at + (16 << 10) * 9 // 10:at + (16 << 10)] = 0
        few_bits = a & 0xFFF0
        for data in (zeros.tobytes(), few_bits.tobytes()):
            fed.clear()
            f = codec.encode(data, "planes-zstd1")
            assert codec.read_header(f).flags & codec.FLAG_LO_ZSTD
            assert sum(fed) >= 2 << 20 and codec.decode(f) == data
    # fp16 KV's low plane (its low mantissa bits) is stored as it is too; the frame decodes.
    p16 = b"".join(fp16_pages)[:1 << 20]
    f = codec.encode(p16, "planes-zstd1")
    assert not codec.read_header(f).flags & codec.FLAG_LO_ZSTD and codec.decode(f) == p16
