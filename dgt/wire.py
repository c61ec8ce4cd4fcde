"""DGT wire format: one fixed 48-byte big-endian header before every frame, encoded/decoded in bulk with numpy.

See docs/protocol.md for the field table. Single-frame decoding raises :class:`WireError` for anything invalid;
the batch decoder (for GRO batches and fuzzing receivers) returns a validity mask instead of raising, so one bad
datagram never costs the good ones around it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum, IntFlag

import numpy as np
import torch

from dgt.errors import WireError as WireError  # re-exported: dgt.wire.WireError is public

MAGIC = 0x4447  # "DG"
MAC_TAG = 8  # bytes of a datagram's MAC trailer (Flags.MAC)
VERSION = 1

HEADER_DTYPE = np.dtype(
    [
        ("magic", ">u2"),
        ("version", "u1"),
        ("ftype", "u1"),
        ("flags", "u1"),
        ("dtype", "u1"),
        ("codec", "u1"),
        ("lane", "u1"),
        ("token", ">u8"),
        ("rank", ">u4"),
        ("round", ">u4"),
        ("bucket", ">u4"),
        ("block", ">u4"),
        ("offset", ">u8"),
        ("count", ">u4"),
        ("length", ">u4"),
    ]
)
HEADER_SIZE = HEADER_DTYPE.itemsize
assert HEADER_SIZE == 48


class FrameType(IntEnum):
    DATA = 1  # elements [offset, offset+count) of a bucket, starting in block `block`
    ROUND_BEGIN = 2  # layout of the round's bucket (tensor sizes, block and fragment size)
    ROUND_END = 3  # on the reliable lane after the last important block: what was sent
    DROP_REPORT = 4  # receiver -> sender: bitmap of the blocks that arrived; closes the round for the sender
    CONTROL = 5  # session control (hello, goodbye, ping): small JSON payload
    BULK = 6  # reliable lane only: elements [offset, offset+count) of a lossless message of `block` elements


class Flags(IntFlag):
    NONE = 0
    IMPORTANT = 1  # block classified important (travels on the reliable lane)
    FRAGMENT = 2  # the frame carries one fragment of a single block (unreliable lanes)
    RESEND = 4  # error-feedback data from an earlier round's drop report
    CLOSED = 8  # DROP_REPORT: the receiver has finalised the round
    NO_REPORT = 16  # ROUND_BEGIN: a lossless round whose sender does not wait for a drop report: send none
    TIMING = 32  # DROP_REPORT: a timing trailer follows the bitmap (dgt.protocol.report)
    MAC = 64  # datagram: an 8-byte tag follows the payload (dgt.protocol.datagram_mac); ``length`` excludes it


class WireDType(IntEnum):
    FLOAT32 = 0
    FLOAT16 = 1
    BFLOAT16 = 2
    UINT8 = 3
    INT32 = 4
    INT64 = 5
    FLOAT64 = 6
    INT8 = 7


TORCH_OF = {
    WireDType.FLOAT32: torch.float32,
    WireDType.FLOAT16: torch.float16,
    WireDType.BFLOAT16: torch.bfloat16,
    WireDType.UINT8: torch.uint8,
    WireDType.INT32: torch.int32,
    WireDType.INT64: torch.int64,
    WireDType.FLOAT64: torch.float64,
    WireDType.INT8: torch.int8,
}
WIRE_OF = {v: k for k, v in TORCH_OF.items()}
ITEMSIZE = np.array([4, 2, 2, 1, 4, 8, 8, 1], dtype=np.int64)


def wire_dtype(dtype: torch.dtype) -> WireDType:
    try:
        return WIRE_OF[dtype]
    except KeyError:
        raise WireError(f"dtype {dtype} has no wire encoding") from None


@dataclass(frozen=True)
class Limits:
    """Upper bounds a receiver enforces on every header, so a hostile sender can never make it allocate unboundedly."""

    max_payload: int = 64 << 20  # bytes in one frame
    max_bucket_elems: int = 1 << 30  # elements in one bucket
    max_tensors: int = 1 << 16  # tensors in one bucket layout
    max_rank: int = 1 << 16
    max_block: int = 1 << 20  # elements per block
    max_open_rounds: int = 64  # rounds in flight per sender at one receiver (memory: max_open_bytes overall)
    max_control: int = 1 << 16  # bytes of a CONTROL payload


DEFAULT_LIMITS = Limits()


@dataclass
class Frame:
    """One decoded frame: header fields plus a zero-copy view of its payload."""

    ftype: FrameType
    flags: Flags
    dtype: WireDType
    codec: int
    lane: int
    token: int
    rank: int
    round: int
    bucket: int
    block: int
    offset: int
    count: int
    payload: memoryview

    @property
    def length(self) -> int:
        return len(self.payload)


# -- encoding ------------------------------------------------------------------------------------------------------


def headers(n: int) -> np.ndarray:
    """A zeroed array of ``n`` headers with magic and version filled in; callers fill columns vectorised."""
    h = np.zeros(n, dtype=HEADER_DTYPE)
    h["magic"] = MAGIC
    h["version"] = VERSION
    return h


def encode_header(
    ftype: FrameType,
    *,
    token: int,
    rank: int,
    round: int = 0,
    bucket: int = 0,
    block: int = 0,
    offset: int = 0,
    count: int = 0,
    length: int = 0,
    flags: int = 0,
    dtype: int = 0,
    codec: int = 0,
    lane: int = 0,
) -> bytes:
    """One header, packed with :mod:`struct` (a fraction of numpy's per-call cost for a single row)."""
    return _HEADER.pack(MAGIC, VERSION, ftype, flags, dtype, codec, lane, token, rank, round, bucket, block, offset,
                        count, length)


def encode_frame(ftype: FrameType, payload: bytes = b"", **fields: int) -> bytes:
    """Header + payload as one bytes object (control-plane frames; data frames use :func:`headers` in bulk)."""
    return encode_header(ftype, length=len(payload), **fields) + bytes(payload)


# -- round control payloads -----------------------------------------------------------------------------------------

_BEGIN = struct.Struct(">QIII")  # numel, block_elems, frag_elems, ntensors; then ntensors x u64 sizes
_END = struct.Struct(">IIII")  # important blocks, unimportant blocks, important frames, unimportant frames


def encode_round_begin(numel: int, block: int, frag: int, sizes: list[int]) -> bytes:
    return _BEGIN.pack(numel, block, frag, len(sizes)) + np.asarray(sizes, dtype=">u8").tobytes()


def decode_round_begin(payload: memoryview, limits: Limits = DEFAULT_LIMITS) -> tuple[int, int, int, list[int]]:
    if len(payload) < _BEGIN.size:
        raise WireError("ROUND_BEGIN payload truncated")
    numel, block, frag, ntensors = _BEGIN.unpack_from(payload)
    if ntensors > limits.max_tensors or len(payload) != _BEGIN.size + 8 * ntensors:
        raise WireError(f"ROUND_BEGIN announces {ntensors} tensors in {len(payload)} bytes")
    if not 0 < block <= limits.max_block or not 0 < frag <= block:
        raise WireError(f"ROUND_BEGIN block {block} / fragment {frag} out of range")
    if numel > limits.max_bucket_elems:
        raise WireError(f"ROUND_BEGIN bucket of {numel} elements exceeds limit {limits.max_bucket_elems}")
    sizes = np.frombuffer(payload, dtype=">u8", offset=_BEGIN.size, count=ntensors)
    if int(sizes.sum(dtype=np.uint64)) != numel or (ntensors and int(sizes.max()) > numel):
        raise WireError("ROUND_BEGIN tensor sizes do not add up to the bucket size")
    return numel, block, frag, [int(s) for s in sizes]


def encode_round_end(imp_blocks: int, unimp_blocks: int, imp_frames: int, unimp_frames: int) -> bytes:
    return _END.pack(imp_blocks, unimp_blocks, imp_frames, unimp_frames)


def decode_round_end(payload: memoryview) -> tuple[int, int, int, int]:
    if len(payload) != _END.size:
        raise WireError("ROUND_END payload has the wrong size")
    return _END.unpack(payload)


# -- decoding -------------------------------------------------------------------------------------------------------

REASONS = ("ok", "magic", "version", "ftype", "dtype", "length", "count", "token", "rank", "truncated")


_SMALL_BATCH = 8  # below this many headers a per-header struct check is cheaper than numpy's per-call cost
_DATA, _CONTROL, _BULK = int(FrameType.DATA), int(FrameType.CONTROL), int(FrameType.BULK)
_LAST = max(FrameType)


def validate(h: np.ndarray, limits: Limits = DEFAULT_LIMITS, token: int | None = None) -> np.ndarray:
    """Vectorised header check: an int8 reason code per header (0 = valid, else an index into ``REASONS``)."""
    if len(h) < _SMALL_BATCH:
        raw = h.tobytes()
        return np.array([validate_one(raw[i * HEADER_SIZE :], limits, token) for i in range(len(h))], np.int8)
    reason = np.zeros(len(h), dtype=np.int8)

    def mark(bad: np.ndarray, code: int) -> None:
        reason[(reason == 0) & bad] = code

    mark(h["magic"] != MAGIC, 1)
    mark(h["version"] != VERSION, 2)
    mark((h["ftype"] < _DATA) | (h["ftype"] > _LAST), 3)
    mark(h["dtype"] >= len(ITEMSIZE), 4)
    length = h["length"].astype(np.int64)
    mark(length > limits.max_payload, 5)
    is_bulk = h["ftype"] == _BULK
    is_data = (h["ftype"] == _DATA) | is_bulk
    itemsize = ITEMSIZE[np.minimum(h["dtype"], len(ITEMSIZE) - 1)]
    count = h["count"].astype(np.int64)
    mark(is_data & (count * itemsize != length), 6)
    end = h["offset"].astype(np.uint64) + h["count"].astype(np.uint64)
    mark(is_data & ((end > limits.max_bucket_elems) | (h["offset"] > limits.max_bucket_elems)), 6)
    mark(is_bulk & ((h["block"] > limits.max_bucket_elems) | (end > h["block"])), 6)
    mark((h["ftype"] == _CONTROL) & (length > limits.max_control), 5)
    if token is not None:
        mark(h["token"] != np.uint64(token), 7)
    mark(h["rank"] >= limits.max_rank, 8)
    return reason


_HEADER = struct.Struct(">HBBBBBBQIIIIQII")  # HEADER_DTYPE as a struct, for one header at a time
_FTYPES = range(FrameType.DATA, _LAST + 1)


def validate_one(buf: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS, token: int | None = None) -> int:
    """:func:`validate` for a single header (``buf`` holds at least HEADER_SIZE bytes) without numpy's per-call cost:
    the reliable lane checks one header per large frame. Same reason codes, same order of checks."""
    magic, version, ftype, _flags, dtype, _codec, _lane, tok, rank, _rnd, _bkt, blk, offset, count, length = (
        _HEADER.unpack_from(buf)
    )
    if magic != MAGIC:
        return 1
    if version != VERSION:
        return 2
    if ftype not in _FTYPES:
        return 3
    if dtype >= len(ITEMSIZE):
        return 4
    if length > limits.max_payload:
        return 5
    if ftype == FrameType.DATA or ftype == FrameType.BULK:
        if count * int(ITEMSIZE[dtype]) != length:
            return 6
        if (offset + count) % (1 << 64) > limits.max_bucket_elems or offset > limits.max_bucket_elems:
            return 6
        if ftype == FrameType.BULK and (blk > limits.max_bucket_elems or offset + count > blk):
            return 6
    if ftype == FrameType.CONTROL and length > limits.max_control:
        return 5
    if token is not None and tok != token:
        return 7
    if rank >= limits.max_rank:
        return 8
    return 0


def _frame(h: np.void, payload: memoryview) -> Frame:
    return Frame(
        FrameType(int(h["ftype"])),
        Flags(int(h["flags"])),
        WireDType(int(h["dtype"])),
        int(h["codec"]),
        int(h["lane"]),
        int(h["token"]),
        int(h["rank"]),
        int(h["round"]),
        int(h["bucket"]),
        int(h["block"]),
        int(h["offset"]),
        int(h["count"]),
        payload,
    )


def decode_header(
    buf: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS, token: int | None = None
) -> np.void:
    """Parse and validate one header; raises :class:`WireError` naming the first problem."""
    if len(buf) < HEADER_SIZE:
        raise WireError(f"truncated header: {len(buf)} of {HEADER_SIZE} bytes")
    h = np.frombuffer(buf, dtype=HEADER_DTYPE, count=1)
    code = int(validate(h, limits, token)[0])
    if code:
        raise WireError(f"invalid header: {REASONS[code]}")
    rec: np.void = h[0]
    return rec


def decode_frames(
    buf: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS, token: int | None = None
) -> list[Frame]:
    """Decode a byte string holding back-to-back frames (a TCP stream chunk, a datagram). Raises WireError."""
    mv = memoryview(buf).cast("B")
    frames = []
    pos = 0
    while pos < len(mv):
        h = decode_header(mv[pos : pos + HEADER_SIZE], limits, token)
        end = pos + HEADER_SIZE + int(h["length"])
        if end > len(mv):
            raise WireError(f"truncated payload: header says {int(h['length'])} bytes, {len(mv) - pos - 48} present")
        frames.append(_frame(h, mv[pos + HEADER_SIZE : end]))
        pos = end
    return frames


@dataclass
class Batch:
    """Headers of a batch of datagrams (one GRO read, or many reads) with their payload positions in one buffer."""

    headers: np.ndarray
    payload_pos: np.ndarray  # int64 byte offset of each payload in ``buf``
    reason: np.ndarray  # int8, 0 = valid
    buf: memoryview

    @property
    def valid(self) -> np.ndarray:
        valid: np.ndarray = self.reason == 0  # (numpy's stubs type an array comparison as Any)
        return valid


def decode_datagrams(
    buf: bytes | bytearray | memoryview,
    sizes: np.ndarray | list[int],
    limits: Limits = DEFAULT_LIMITS,
    token: int | None = None,
) -> Batch:
    """Decode ``len(sizes)`` datagrams laid back to back in ``buf`` (as GRO delivers them) without raising.

    A datagram is valid iff its header validates and header + payload length (+ the MAC tag when ``Flags.MAC``)
    equals the datagram size exactly.
    Headers are gathered with one numpy copy (no Python loop over datagrams).
    """
    mv = memoryview(buf).cast("B")
    sizes = np.asarray(sizes, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])) if len(sizes) else np.zeros(0, np.int64)
    short = sizes < HEADER_SIZE
    raw = np.frombuffer(mv, dtype=np.uint8)
    if len(raw) >= HEADER_SIZE:  # one gather of 48-byte rows through an overlapping strided view of the buffer
        rows = np.lib.stride_tricks.as_strided(raw, shape=(len(raw) - HEADER_SIZE + 1, HEADER_SIZE), strides=(1, 1))
        hdr_bytes = rows[np.minimum(starts, len(raw) - HEADER_SIZE)]  # a short datagram at the end: truncated
    else:
        hdr_bytes = np.zeros((len(sizes), HEADER_SIZE), np.uint8)
    h = np.ascontiguousarray(hdr_bytes).view(HEADER_DTYPE).reshape(-1)
    reason = validate(h, limits, token)
    tagged = ((h["flags"] & Flags.MAC) != 0).astype(np.int64) * MAC_TAG
    reason[(reason == 0) & (h["length"].astype(np.int64) + HEADER_SIZE + tagged != sizes)] = REASONS.index("length")
    reason[short] = REASONS.index("truncated")
    return Batch(h, starts + HEADER_SIZE, reason, mv)


def frame_at(batch: Batch, i: int) -> Frame:
    pos = int(batch.payload_pos[i])
    return _frame(batch.headers[i], batch.buf[pos : pos + int(batch.headers[i]["length"])])
