"""Only members join a session (issue 22): every connection proves the session key by HMAC challenge-response bound
to ranks and session; a process that knows only the token (readable in the c10d store) cannot open a session link or
a stream lane claiming a member's rank. Real endpoints on loopback."""

import dataclasses
import socket

import pytest
import torch
import trio

from dgt import wire
from dgt.harness.endpoints import connected_pair
from dgt.transport import Endpoint, Security, Timeouts, TransportConfig, auth, control

TOKEN = 0x22_0022


def _pair(secret_a=b"s3cret", secret_b=b"s3cret", timeout=3.0):
    return connected_pair(TOKEN, TransportConfig(timeouts=Timeouts(peer=timeout), security=Security(secret=secret_a)),
                          TransportConfig(timeouts=Timeouts(peer=timeout), security=Security(secret=secret_b)))


def _attacker_hello(port: int, claimed_rank: int, **fields) -> list[str]:
    """A local process that read the token from the store: dial, say hello as ``claimed_rank``, answer a challenge
    with a guessed proof; the ops it got back."""
    ops = []
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.settimeout(5)
        hello = control.control(TOKEN, claimed_rank, control.HELLO, address={"host": "127.0.0.1", "tcp_port": 1,
                                "udp_ports": [2]}, lanes=1, nonce=auth.nonce(), **fields)
        s.sendall(hello)
        f = s.makefile("rb")
        for _ in range(2):
            head = f.read(wire.HEADER_SIZE)
            if len(head) < wire.HEADER_SIZE:
                break
            h = wire.decode_header(head)
            body = f.read(int(h["length"]))
            _, msg = control.parse(head + body)
            ops.append(msg["op"])
            if msg["op"] != control.CHALLENGE:
                break
            # without the key: a proof made with the key derived from the token alone
            guess = auth.proof(auth.session_key(TOKEN, None), "dialer", claimed_rank, 1, "", msg["nonce"], "x")
            s.sendall(control.control(TOKEN, claimed_rank, control.AUTH, proof=guess))
    return ops


def test_stream_lane_hijack_with_the_token_alone_is_refused_and_the_session_stays_correct():
    async def main():
        async with _pair() as (a, b):
            port = b.address.tcp_port
            for fields in ({"stream": True, "direction": 0}, {"stream": True, "direction": 1}, {}):
                ops = await trio.to_thread.run_sync(lambda f=fields: _attacker_hello(port, 0, **f))
                assert control.WELCOME not in ops, (fields, ops)
                assert ops[-1] == control.REFUSE, (fields, ops)
            assert b.receiver.counters.reasons.get("auth", 0) == 3
            # the members' session is untouched: a lossless round still delivers exactly what rank 0 sent
            x = torch.arange(5000, dtype=torch.float32)
            async with trio.open_nursery() as n:
                n.start_soon(a.send_round, 1, 5, 0, x)
                res = await b.recv_round(0, 5, 0, timeout=10)
            assert torch.equal(res.data, x)

    trio.run(main)


def test_members_with_different_secrets_cannot_connect():
    from dgt.errors import DgtError

    async def main():
        with pytest.raises(DgtError, match="session key|refused|did not|hung up|connect"):
            async with _pair(b"one", b"two", timeout=2.0):
                pytest.fail("members with different secrets connected")

    trio.run(main)


def test_secret_sources(monkeypatch, tmp_path):
    monkeypatch.delenv("DGT_SECRET", raising=False)
    monkeypatch.delenv("DGT_SECRET_FILE", raising=False)
    assert auth.user_secret() is None
    monkeypatch.setenv("DGT_SECRET", "abc")
    assert auth.user_secret() == b"abc"
    assert auth.user_secret(b"explicit") == b"explicit"
    monkeypatch.delenv("DGT_SECRET")
    p = tmp_path / "key"
    p.write_bytes(b"from-file\n")
    monkeypatch.setenv("DGT_SECRET_FILE", str(p))
    assert auth.user_secret() == b"from-file"
    with pytest.raises(ValueError, match="empty"):
        auth.user_secret("")
    k1, k2 = auth.session_key(1, b"s"), auth.session_key(2, b"s")
    assert k1 != k2 and k1 != auth.session_key(1, b"t")  # bound to the session and to the secret
    assert "secret" not in TransportConfig(security=Security(secret=b"zz")).to_dict()["security"]
    assert "zz" not in repr(TransportConfig(security=Security(secret="zz")))


async def _round_ok(a, b, bucket):
    x = torch.arange(3000, dtype=torch.float32) + bucket
    async with trio.open_nursery() as n:
        n.start_soon(a.send_round, 1, bucket, 0, x)
        res = await b.recv_round(0, bucket, 0, timeout=10)
    return torch.equal(res.data, x)


def _silent(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        try:
            s = socket.socket()
        except OSError:  # out of descriptors: what the caller wants
            break
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        socks.append(s)
    return socks


def test_silent_connections_are_capped_and_accept_errors_survived():
    import resource

    async def main():
        async with _pair() as (a, b):
            b.cfg.security = dataclasses.replace(b.cfg.security, max_pending_handshakes=8)
            socks = []
            try:
                socks = _silent(b.address.tcp_port, 40)
                await trio.sleep(0.5)
                assert b.receiver.counters.reasons.get("handshake-cap", 0) >= 20, b.receiver.counters.reasons
                assert b.handshake.pending <= 8
                # descriptors run out: accept fails with EMFILE; the endpoint counts it and keeps serving
                soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                for s in socks:
                    s.close()
                await trio.sleep(0.2)
                import os

                used = len(os.listdir("/proc/self/fd"))
                resource.setrlimit(resource.RLIMIT_NOFILE, (used + 20, hard))
                try:
                    socks = _silent(b.address.tcp_port, 30)  # the dialing ends take descriptors too
                    await trio.sleep(0.5)
                finally:
                    for s in socks:
                        s.close()
                    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
                assert b.receiver.counters.reasons.get("accept:EMFILE", 0) >= 1, b.receiver.counters.reasons
                await trio.sleep(0.2)
                assert await _round_ok(a, b, 9)  # the session survived both
            finally:
                for s in socks:
                    s.close()

    trio.run(main)


def test_a_pending_handshake_holds_a_small_buffer_and_only_control_frames():
    """Each silent connection held a 1 MiB staging buffer until connect_timeout (16 of them: 16 MiB); until a
    peer proves the key its connection stages 4 KiB, and a frame that is not CONTROL ends the handshake before its
    payload is read."""
    import tracemalloc

    async def main():
        async with _pair() as (a, b):
            socks = []
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                socks = _silent(b.address.tcp_port, 16)
                await trio.sleep(0.5)
                assert b.handshake.pending == 16
                held = tracemalloc.get_traced_memory()[0] - before
                assert held < 16 * 64 * 1024, held  # was >= 16 MiB
                # a BULK header announcing a 16 MiB payload, token right, no hello: refused before any payload is read
                s = socket.create_connection(("127.0.0.1", b.address.tcp_port), timeout=5)
                socks.append(s)
                s.sendall(wire.encode_header(wire.FrameType.BULK, token=TOKEN, rank=0, length=16 << 20))
                await trio.sleep(0.3)
                assert b.handshake.pending == 16 and b.receiver.counters.reasons.get("handshake", 0) >= 1
                assert tracemalloc.get_traced_memory()[0] - before < 16 * 64 * 1024
            finally:
                tracemalloc.stop()
                for s in socks:
                    s.close()
            await trio.sleep(0.2)
            assert await _round_ok(a, b, 4)  # an authenticated link still stages whole rounds

    trio.run(main)


def test_a_proof_is_bound_to_both_ranks_both_nonces_the_purpose_the_role_and_the_session():
    key = auth.session_key(TOKEN, b"s3cret")
    dn, an = auth.nonce(), auth.nonce()
    good = auth.proof(key, "dialer", 0, 1, dn, an, "stream:0")
    assert auth.verify(key, good, "dialer", 0, 1, dn, an, "stream:0")
    wrong = [
        (key, "acceptor", 0, 1, dn, an, "stream:0"),  # reflected back as the other side's proof
        (key, "dialer", 2, 1, dn, an, "stream:0"),  # another claimed rank
        (key, "dialer", 0, 2, dn, an, "stream:0"),  # shown to another rank
        (key, "dialer", 0, 1, auth.nonce(), an, "stream:0"),  # replayed into another connection
        (key, "dialer", 0, 1, dn, auth.nonce(), "stream:0"),
        (key, "dialer", 0, 1, dn, an, "stream:1"),  # the other lane direction
        (key, "dialer", 0, 1, dn, an, "session"),
        (auth.session_key(TOKEN + 1, b"s3cret"), "dialer", 0, 1, dn, an, "stream:0"),  # another session
        (auth.session_key(TOKEN, b"other"), "dialer", 0, 1, dn, an, "stream:0"),  # another secret
    ]
    for args in wrong:
        assert not auth.verify(args[0], good, *args[1:]), args[1:]
    assert not auth.verify(key, None, "dialer", 0, 1, dn, an, "stream:0")
    assert not auth.verify(key, good.encode(), "dialer", 0, 1, dn, an, "stream:0")


def test_without_a_secret_the_trust_boundary_is_noted_once(monkeypatch, caplog):
    import logging

    monkeypatch.setattr(auth, "_noted", False)
    with caplog.at_level(logging.WARNING, logger="dgt.auth"):
        k = auth.session_key(TOKEN, None)
        auth.session_key(TOKEN, None)
        auth.session_key(TOKEN, b"given")
    notes = [r for r in caplog.records if "trust boundary" in r.getMessage()]
    assert len(notes) == 1 and "c10d store" in notes[0].getMessage()
    assert k != auth.session_key(TOKEN, b"given")


def test_a_member_without_a_live_session_link_cannot_open_a_stream_lane():
    """Stream lanes are authorised through the authenticated session: a process holding the key and the token
    but without a session link to rank 1 is refused a stream lane; once the session link is up, lanes open."""
    from dgt.errors import ProtocolError
    from dgt.transport.streams import Hop

    async def main():
        cfg = TransportConfig(timeouts=Timeouts(peer=3), security=Security(secret=b"s3cret"))
        async with Endpoint.open(0, TOKEN, cfg, host="127.0.0.1") as a, Endpoint.open(1, TOKEN, cfg, "127.0.0.1") as b:
            port = b.address.tcp_port
            for direction in (0, 1):
                with pytest.raises(ProtocolError, match="no live session link"):
                    await a.handshake._hello(1, "127.0.0.1", port, 3, "a stream lane", stream=True, direction=direction)
            assert not b.streams.lanes and not b.streams._halves
            async with trio.open_nursery() as n:
                n.start_soon(a.connect, {1: b.address})
                n.start_soon(b.connect, {0: a.address})
            x, land = torch.arange(100, dtype=torch.float32), torch.empty(100)
            async with trio.open_nursery() as n:
                n.start_soon(a.exchange, [Hop(2, 0, send_to=1, payload=x)])
                await b.exchange([Hop(2, 0, recv_from=0, land=land)])
            assert torch.equal(land, x) and 0 in b.streams.lanes

    trio.run(main)


def test_other_accept_errors_are_counted_and_survived_too():
    """ENFILE, ENOBUFS, ECONNABORTED from accept: counted per errno, the endpoint keeps accepting."""
    import errno

    async def main():
        async with _pair() as (a, b):
            real, fails = b.sockets.listener.accept, [errno.ENFILE, errno.ENOBUFS, errno.ECONNABORTED]

            async def accept():
                if fails:
                    raise OSError(fails.pop(0), "injected")
                return await real()

            b.sockets.listener.accept = accept  # the loop calls it anew for each connection
            before = b.receiver.counters.reasons.get("handshake", 0)
            with socket.create_connection(("127.0.0.1", b.address.tcp_port), timeout=5) as s:
                s.sendall(b"not a hello" * 10)  # wakes the accept under way; the next ones fail as injected
            with trio.fail_after(5):
                while fails or b.receiver.counters.reasons.get("handshake", 0) == before:
                    await trio.sleep(0.05)
            with socket.create_connection(("127.0.0.1", b.address.tcp_port), timeout=5) as s:
                s.sendall(b"still not a hello" * 10)  # accepted after the errors: refused as a handshake
            with trio.fail_after(5):
                while b.receiver.counters.reasons.get("handshake", 0) < before + 2:
                    await trio.sleep(0.05)
            reasons = b.receiver.counters.reasons
            assert all(reasons.get(f"accept:{n}", 0) == 1 for n in ("ENFILE", "ENOBUFS", "ECONNABORTED")), reasons
            assert await _round_ok(a, b, 6)

    trio.run(main)
