"""Wire format: round trips (hypothesis), and a fuzzer that may only ever see WireError."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dgt import wire
from dgt.errors import WireError

u8 = st.integers(0, 255)
u32 = st.integers(0, 2**32 - 1)


@settings(max_examples=200, deadline=None)
@given(
    ftype=st.sampled_from([wire.FrameType.CONTROL, wire.FrameType.ROUND_END, wire.FrameType.DROP_REPORT]),
    flags=st.integers(0, 15),
    lane=u8,
    codec=u8,
    token=st.integers(0, 2**64 - 1),
    rank=st.integers(0, 1000),
    rnd=u32,
    bucket=u32,
    block=u32,
    offset=st.integers(0, 2**20),
    payload=st.binary(max_size=300),
)
def test_control_frames_round_trip(ftype, flags, lane, codec, token, rank, rnd, bucket, block, offset, payload):
    b = wire.encode_frame(ftype, payload, token=token, rank=rank, round=rnd, bucket=bucket, block=block,
                          offset=offset, flags=flags, lane=lane, codec=codec)
    (f,) = wire.decode_frames(b, token=token)
    assert (f.ftype, f.flags, f.lane, f.codec, f.token, f.rank) == (ftype, flags, lane, codec, token, rank)
    assert (f.round, f.bucket, f.block, f.offset) == (rnd, bucket, block, offset)
    assert bytes(f.payload) == payload


@settings(max_examples=100, deadline=None)
@given(
    dtype=st.sampled_from(list(wire.WireDType)),
    n=st.integers(1, 40),
    counts=st.lists(st.integers(0, 64), min_size=1, max_size=20),
    seed=st.integers(0, 1000),
)
def test_many_data_frames_round_trip_vectorised(dtype, n, counts, seed):
    rng = np.random.default_rng(seed)
    counts = np.array(counts)
    h = wire.headers(len(counts))
    h["ftype"] = wire.FrameType.DATA
    h["dtype"] = dtype
    h["token"] = 99
    h["offset"] = np.cumsum(counts) - counts
    h["count"] = counts
    h["block"] = np.arange(len(counts))
    isz = int(wire.ITEMSIZE[dtype])
    h["length"] = counts * isz
    payloads = [rng.integers(0, 256, int(c) * isz, dtype=np.uint8).tobytes() for c in counts]
    stream = b"".join(h[i : i + 1].tobytes() + payloads[i] for i in range(len(counts)))
    frames = wire.decode_frames(stream, token=99)
    assert [bytes(f.payload) for f in frames] == payloads
    assert [f.offset for f in frames] == h["offset"].tolist()
    # the same frames as datagrams, vectorised batch decode
    batch = wire.decode_datagrams(stream, [wire.HEADER_SIZE + len(p) for p in payloads], token=99)
    assert batch.valid.all()
    assert batch.headers["count"].tolist() == counts.tolist()


def good_frame() -> bytes:
    payload = np.arange(16, dtype=np.float32).tobytes()
    return wire.encode_frame(wire.FrameType.DATA, payload, token=5, rank=1, count=16, offset=32, dtype=0)


@pytest.mark.parametrize(
    "field,value,reason",
    [("magic", 0x1234, "magic"), ("version", 9, "version"), ("ftype", 77, "ftype"), ("dtype", 200, "dtype"),
     ("count", 15, "count"), ("length", 2**31, "length"), ("token", 6, "token"), ("offset", 2**62, "count")],
)
def test_each_invalid_field_is_named(field, value, reason):
    h = np.frombuffer(bytearray(good_frame()[:48]), dtype=wire.HEADER_DTYPE).copy()
    h[field] = value
    with pytest.raises(WireError, match=reason):
        wire.decode_header(h.tobytes(), token=5)


def test_truncation_is_a_wire_error():
    b = good_frame()
    for cut in (0, 1, 47, 48, len(b) - 1):
        if cut == 0:
            assert wire.decode_frames(b[:0]) == []
            continue
        with pytest.raises(WireError):
            wire.decode_frames(b[:cut])


def test_round_begin_limits_bound_allocation():
    ok = wire.encode_round_begin(3000, 1024, 256, [1000, 2000])
    assert wire.decode_round_begin(memoryview(ok)) == (3000, 1024, 256, [1000, 2000])
    lim = wire.Limits(max_bucket_elems=10_000, max_tensors=4)
    for bad in (
        wire.encode_round_begin(10**12, 1024, 256, [10**12]),  # too big a bucket
        wire.encode_round_begin(3000, 1024, 256, [1000, 1000]),  # sizes do not add up
        wire.encode_round_begin(3000, 1024, 2048, [3000]),  # fragment larger than block
        wire.encode_round_begin(5, 1024, 256, [1] * 5),  # too many tensors
        ok[:-3],
    ):
        with pytest.raises(WireError):
            wire.decode_round_begin(memoryview(bad), lim)


@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=400), mutate=st.lists(st.tuples(st.integers(0, 200), u8), max_size=8))
def test_fuzz_decoder_only_raises_wire_error(data, mutate):
    # random bytes, and mutations of a valid frame: either valid frames or WireError, nothing else
    for blob in (data, good_frame() + data):
        b = bytearray(blob)
        for pos, val in mutate:
            if pos < len(b):
                b[pos] = val
        try:
            frames = wire.decode_frames(bytes(b))
        except WireError:
            continue
        for f in frames:
            assert len(f.payload) <= wire.DEFAULT_LIMITS.max_payload
        sizes = [len(b)]
        batch = wire.decode_datagrams(bytes(b), sizes)  # the batch path never raises
        assert len(batch.reason) == 1
