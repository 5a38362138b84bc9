"""Bytes copied between two file handles, a piece at a time: what a
``copy_file_range`` that cannot name blobs does (within a tree or between
two), so that no byte crosses FUSE twice."""

from __future__ import annotations

# A copy_file_range the blobs cannot serve is copied in pieces of this size.
COPY_PIECE = 1 << 20


async def copy_pieces(read, fh_in: int, off_in: int, write, fh_out: int, off_out: int,
                      length: int) -> int:
    """Copy up to *length* bytes with ``read(fh, off, size)`` and ``write(fh, off,
    data)`` handlers, COPY_PIECE at a time: the bytes copied (fewer at the
    source's end, or where a write took less)."""
    done = 0
    while done < length:
        data = await read(fh_in, off_in + done, min(COPY_PIECE, length - done))
        if not data:
            break
        n = await write(fh_out, off_out + done, data)
        done += n
        if n < len(data):
            break
    return done
