"""The full-duplex hop loop (dgt.channels.duplex): the native loop and its Python twin on real socket pairs, both
held to one contract: every byte both ways, the fused add equal to torch's, and a clear error for a wrong header,
a closed peer, silence and cancellation."""

import os
import shutil
import socket
import threading
import time

import pytest
import torch

from dgt import wire
from dgt.channels import duplex as dx
from dgt.errors import PeerClosed, PeerTimeout, ProtocolError

# the native loop in one thread, the native loop with the send half on a second thread, the Python twin
TWINS = [pytest.param(True, id="native"), pytest.param("split", id="native-split"), pytest.param(False, id="python")]


def _skip_unbuilt(native):
    if native and not dx.NATIVE:
        pytest.skip("the native hop loop was not built (no C compiler at install time)")


def _mode(native) -> dict:
    return {"native": bool(native), "split": native == "split"}


def test_native_loop_is_built_where_a_compiler_is():
    """An install on a machine with a C compiler must not silently fall back to the Python loop."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the Python twin is the expected hop loop")
    assert dx.NATIVE


def _pair():
    a, b = socket.socketpair()
    for s in (a, b):
        s.setblocking(False)
    return a, b


def _header(rank, bucket, n, rnd=0):
    return wire.encode_header(wire.FrameType.BULK, token=7, rank=rank, round=rnd, bucket=bucket, block=n, count=n,
                              length=4 * n, dtype=wire.wire_dtype(torch.float32))


def _run_both(native, left, right, timeout=10.0):
    """Run two hops at once in threads: ``left`` and ``right`` are kwargs for dx.duplex; returns both results."""
    out = {}

    def go(name, kw):
        try:
            out[name] = dx.duplex(timeout=timeout, **_mode(native), **kw)
        except Exception as exc:  # reported to the test
            out[name] = exc

    ts = [threading.Thread(target=go, args=("l", left)), threading.Thread(target=go, args=("r", right))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout + 5)
    assert not any(t.is_alive() for t in ts), "a hop did not return"
    return out["l"], out["r"]


@pytest.mark.parametrize("native", TWINS)
@pytest.mark.parametrize("n", [0, 1, 1000, 1_000_003])
def test_one_socket_both_ways_lands_every_byte(native, n):
    """Two ranks' hop on one connection (a 2-rank ring): each sends its tensor and receives the other's."""
    _skip_unbuilt(native)
    a, b = _pair()
    xa, xb = torch.randn(n), torch.randn(n)
    la, lb = torch.full((n,), float("nan")), torch.full((n,), float("nan"))
    ha, hb = _header(0, 5, n), _header(1, 5, n)
    ra, rb = _run_both(native, dict(send=a, header=ha, payload=xa.numpy(), recv=a, expect=hb, land=la.numpy()),
                       dict(send=b, header=hb, payload=xb.numpy(), recv=b, expect=ha, land=lb.numpy()))
    assert ra == (wire.HEADER_SIZE + 4 * n, wire.HEADER_SIZE + 4 * n) and rb == ra
    assert torch.equal(la, xb) and torch.equal(lb, xa)


@pytest.mark.parametrize("native", TWINS)
@pytest.mark.parametrize("inplace", [False, True])
def test_fused_add_equals_torch_add(native, inplace):
    """Three ranks' worth of sockets: a sends to b while b sends to c; b adds what it receives to its own chunk.
    Odd length, so the last stretch through the scratch ends mid-scratch."""
    _skip_unbuilt(native)
    n = 700_001
    ab_a, ab_b = _pair()
    bc_b, bc_c = _pair()
    xa, xb = torch.randn(n), torch.randn(n)
    own = torch.randn(n)
    ref = own + xa
    land = own if inplace else torch.full((n,), float("nan"))
    got_c = torch.empty(n)
    ha, hb = _header(0, 1, n), _header(1, 1, n)
    scratch = bytearray(dx.SCRATCH_BYTES)

    def late_sender():  # starts after b waits: the add must cope with the bytes trickling in
        time.sleep(0.1)
        dx.duplex(ab_a, ha, xa.numpy(), None, b"", b"", timeout=10, **_mode(native))

    sender = threading.Thread(target=late_sender)
    sender.start()
    res_b, res_c = _run_both(
        native,
        dict(send=bc_b, header=hb, payload=xb.numpy(), recv=ab_b, expect=ha, land=land.numpy(),
             add_src=own.numpy(), scratch=scratch),
        dict(send=None, header=b"", payload=b"", recv=bc_c, expect=hb, land=got_c.numpy()))
    sender.join(15)
    assert not isinstance(res_b, Exception), res_b
    assert torch.equal(land, ref) and torch.equal(got_c, xb)


def test_python_twin_matches_native_on_the_same_bytes():
    _skip_unbuilt(True)
    n = 300_007
    src, pay = torch.randn(n), torch.randn(n)
    outs = []
    for native in (True, False):
        a, b = _pair()
        land = torch.empty(n)
        h = _header(3, 9, n)
        _run_both(native, dict(send=a, header=h, payload=pay.numpy(), recv=None, expect=b"", land=b""),
                  dict(send=None, header=b"", payload=b"", recv=b, expect=h, land=land.numpy(), add_src=src.numpy(),
                       scratch=bytearray(dx.SCRATCH_BYTES)))
        outs.append(land)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("native", TWINS)
def test_a_different_message_is_a_protocol_error_naming_both(native):
    _skip_unbuilt(native)
    a, b = _pair()
    n = 1000
    x = torch.randn(n)
    with pytest.raises(ProtocolError, match=r"expected rank 0's message 0x2 round 4.*got rank 0's message 0x3 round 4"):
        _run_both_raise(native, a, b, _header(0, 3, n, 4), _header(0, 2, n, 4), x)


def _run_both_raise(native, a, b, sent, expected, x):
    t = threading.Thread(target=lambda: _quiet(dx.duplex, a, sent, x.numpy(), None, b"", b"", timeout=5,
                                               **_mode(native)))
    t.start()
    try:
        dx.duplex(None, b"", b"", b, expected, torch.empty(x.numel()).numpy(), timeout=5, **_mode(native))
    finally:
        b.close()
        t.join(10)


def _quiet(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception:
        pass


@pytest.mark.parametrize("native", TWINS)
def test_garbage_instead_of_a_header_is_a_protocol_error(native):
    _skip_unbuilt(native)
    a, b = _pair()
    a.send(b"\x00" * wire.HEADER_SIZE)
    with pytest.raises(ProtocolError, match="invalid header"):
        dx.duplex(None, b"", b"", b, _header(0, 1, 10), torch.empty(10).numpy(), timeout=5, **_mode(native))


@pytest.mark.parametrize("native", TWINS)
def test_peer_closing_mid_message_is_peer_closed(native):
    _skip_unbuilt(native)
    a, b = _pair()
    h = _header(0, 1, 1000)
    a.send(h + b"\x00" * 100)
    a.close()
    with pytest.raises(PeerClosed, match=f"received {wire.HEADER_SIZE + 100} bytes"):
        dx.duplex(None, b"", b"", b, h, torch.empty(1000).numpy(), timeout=5, **_mode(native))


@pytest.mark.parametrize("native", TWINS)
def test_silence_is_a_timeout_and_a_send_to_nobody_too(native):
    _skip_unbuilt(native)
    a, b = _pair()
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout, match="no progress for 0.3 s"):
        dx.duplex(None, b"", b"", b, _header(0, 1, 10), torch.empty(10).numpy(), timeout=0.3, **_mode(native))
    assert time.monotonic() - t0 < 3
    big = torch.zeros(16 << 20)  # more than both socket buffers hold: the sender stalls with nobody reading
    with pytest.raises(PeerTimeout):
        dx.duplex(a, _header(0, 1, big.numel()), big.numpy(), None, b"", b"", timeout=0.3, **_mode(native))


@pytest.mark.parametrize("native", TWINS)
def test_cancel_fd_stops_a_waiting_hop(native):
    _skip_unbuilt(native)
    a, b = _pair()
    r, w = os.pipe()
    threading.Timer(0.2, os.write, args=(w, b"x")).start()
    t0 = time.monotonic()
    with pytest.raises(dx.HopCancelled):
        dx.duplex(None, b"", b"", b, _header(0, 1, 10), torch.empty(10).numpy(), timeout=30, cancel_fd=r,
                  **_mode(native))
    assert time.monotonic() - t0 < 5
    os.close(r)
    os.close(w)


def test_add_mode_checks_its_buffers():
    with pytest.raises(ValueError, match="scratch"):
        dx.duplex(None, b"", b"", None, b"", torch.empty(4).numpy(), add_src=torch.empty(4).numpy(), timeout=1)
    if dx.NATIVE:
        with pytest.raises(ValueError, match="float32"):
            dx.duplex(None, b"", b"", None, b"", torch.empty(4).numpy(), add_src=torch.empty(3).numpy(),
                      scratch=bytearray(64), timeout=1)


def test_split_hop_send_half_stops_when_the_receive_half_fails():
    """The receive half meets a wrong header while the send half is stuck (nobody reads its peer): the hop ends
    with the protocol error at once, not at the send half's timeout."""
    _skip_unbuilt(True)
    a, b = _pair()  # b receives garbage from a
    c, _d = _pair()  # c sends to d, which nobody reads
    a.send(b"\x00" * wire.HEADER_SIZE)
    big = torch.zeros(16 << 20)
    t0 = time.monotonic()
    with pytest.raises(ProtocolError, match="invalid header"):
        dx.duplex(c, _header(0, 1, big.numel()), big.numpy(), b, _header(0, 1, 10), torch.empty(10).numpy(),
                  timeout=20, native=True, split=True)
    assert time.monotonic() - t0 < 5


def test_split_hop_receive_half_stops_when_the_send_half_fails():
    """The send half's peer is gone (a reset) while the receive half waits for a silent peer: PeerClosed at once."""
    _skip_unbuilt(True)
    a, b = _pair()  # b waits for a, which stays silent
    c, d = _pair()
    d.close()
    big = torch.zeros(1 << 20)
    t0 = time.monotonic()
    with pytest.raises(PeerClosed):
        dx.duplex(c, _header(0, 1, big.numel()), big.numpy(), b, _header(0, 1, 10), torch.empty(10).numpy(),
                  timeout=20, native=True, split=True)
    assert time.monotonic() - t0 < 5
    a.close()


@pytest.mark.parametrize("native", TWINS)
def test_a_closed_socket_is_peer_closed_never_a_skipped_half(native):
    """A closed socket's fd is -1, which the native loop reads as "no such side": the hop must fail, not return
    0 bytes as a success (a ring would then hand back a result it never received)."""
    _skip_unbuilt(native)
    a, b = _pair()
    c, _d = _pair()
    b.close()
    with pytest.raises(PeerClosed, match="receive connection is closed"):
        dx.duplex(c, _header(0, 1, 10), torch.ones(10).numpy(), b, _header(0, 1, 10), torch.empty(10).numpy(),
                  timeout=5, **_mode(native))
    c.close()
    with pytest.raises(PeerClosed, match="send connection is closed"):
        dx.duplex(c, _header(0, 1, 10), torch.ones(10).numpy(), None, b"", b"", timeout=5, **_mode(native))
    a.close()
