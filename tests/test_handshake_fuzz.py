"""Fuzzing the handshake (issue 22: fuzzing stays at 0 crashes): mutated hellos, mutated answers to a genuine
challenge and raw garbage, each on its own connection to a real endpoint on loopback. Every one is refused and
counted, none is welcomed, the endpoint keeps serving its session, and no handshake is left pending."""

import json
import random
import socket

import pytest
import torch
import trio

from dgt import wire
from dgt.harness.endpoints import connected_pair
from dgt.transport import Security, Timeouts, TransportConfig, auth, control

TOKEN = 0x22_F022
ODD = [None, 0, -1, 1 << 70, 1.5, "", "x" * 3000, [], [1, 2], {}, {"host": 5}, True, "stream:0", {"a": [None]}]


def _hello_fields(rng: random.Random) -> dict:
    msg = {"op": "hello", "address": {"host": "127.0.0.1", "tcp_port": 1, "udp_ports": [2]}, "lanes": 1,
           "nonce": auth.nonce(), "mac": True}
    if rng.random() < 0.3:
        msg.update(stream=True, direction=rng.choice([0, 1, 2, -1, "0", None]))
    for k in rng.sample(sorted(msg), rng.randint(0, len(msg))):
        r = rng.random()
        if r < 0.2:
            del msg[k]
        elif r < 0.4 and isinstance(msg[k], dict):
            msg[k] = {**msg[k], rng.choice(sorted(msg[k])): rng.choice(ODD)}
        else:
            msg[k] = rng.choice(ODD)
    if rng.random() < 0.2:
        msg[rng.choice(["x", "op", "proof", "why"])] = rng.choice(ODD)
    return msg


def _frame(rng: random.Random, msg: object) -> bytes:
    payload = json.dumps(msg).encode() if rng.random() < 0.9 else rng.randbytes(rng.randint(0, 300))
    frame = bytearray(wire.encode_frame(wire.FrameType.CONTROL, payload, token=TOKEN, rank=rng.choice([0, 0, 1, 2, 7])))
    for _ in range(rng.choice([0, 0, 0, 1, 3])):  # flipped bytes, header included
        i = rng.randrange(len(frame))
        frame[i] ^= rng.randrange(1, 256)
    return bytes(frame)


def _read_control(f) -> dict | None:
    head = f.read(wire.HEADER_SIZE)
    if len(head) < wire.HEADER_SIZE:
        return None
    body = f.read(int(wire.decode_header(head)["length"]))
    return control.parse(head + body)[1]


def _attack(port: int, seed: int, n: int) -> dict[str, int]:
    """``n`` connections, each with one kind of bad input; what the endpoint answered, counted."""
    rng = random.Random(seed)
    seen: dict[str, int] = {}
    for _ in range(n):
        kind = rng.random()
        with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
            s.settimeout(3)
            f = s.makefile("rb")
            try:
                if kind < 0.15:  # raw garbage
                    s.sendall(rng.randbytes(rng.randint(1, 200)))
                    s.shutdown(socket.SHUT_WR)
                elif kind < 0.6:  # a mutated hello
                    s.sendall(_frame(rng, _hello_fields(rng)))
                    s.shutdown(socket.SHUT_WR)
                else:  # a genuine hello, then a mutated answer to the challenge
                    hello = control.control(TOKEN, 0, control.HELLO, address={"host": "127.0.0.1", "tcp_port": 1,
                                            "udp_ports": [2]}, lanes=1, nonce=auth.nonce(), mac=True)
                    s.sendall(hello)
                    msg = _read_control(f)
                    op = msg and msg.get("op")
                    seen[f"hello->{op}"] = seen.get(f"hello->{op}", 0) + 1
                    answer = {"op": rng.choice(["auth", "auth", "hello", "welcome", 3]),
                              "proof": rng.choice([*ODD, "0" * 64, (msg or {}).get("proof")])}
                    s.sendall(_frame(rng, answer))
                while (msg := _read_control(f)) is not None:
                    seen[msg["op"]] = seen.get(msg["op"], 0) + 1
            except (OSError, ValueError):  # reset by the endpoint, or a frame it cut short
                seen["reset"] = seen.get("reset", 0) + 1
    return seen


@pytest.mark.parametrize("seed", range(2))
def test_fuzzed_handshakes_are_refused_and_the_endpoint_keeps_serving(seed):
    async def main():
        cfg = TransportConfig(timeouts=Timeouts(peer=3, connect=1), security=Security(secret=b"fuzz"))
        async with connected_pair(TOKEN, cfg) as (a, b):
            seen = await trio.to_thread.run_sync(_attack, b.address.tcp_port, seed, 150)
            assert control.WELCOME not in seen, seen
            assert seen.get("hello->challenge", 0) > 20, seen  # the mutated answers did reach the proof check
            with trio.fail_after(5):
                while b.handshake.pending:
                    await trio.sleep(0.05)
            reasons = b.receiver.counters.reasons
            assert reasons.get("handshake", 0) + reasons.get("auth", 0) >= 100, reasons
            assert not b.streams.lanes and not b.streams._halves and set(b.links.table) == {0}
            x = torch.arange(3000, dtype=torch.float32)  # the session is untouched
            async with trio.open_nursery() as n:
                n.start_soon(a.send_round, 1, 1, 0, x)
                res = await b.recv_round(0, 1, 0, timeout=10)
            assert torch.equal(res.data, x)

    trio.run(main)
