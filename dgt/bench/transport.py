"""``dgt bench transport``: one large round between two processes over loopback, in the same run:

- raw: a plain Python socket pair, ``sendall`` / ``recv_into`` into a preallocated buffer (the anchor);
- tcp-ours: our trio TCP channel alone (1 MiB length-prefixed frames, ``recv_into`` in place), no DGT protocol;
- dgt-lossless: the endpoint with every block reliable (p = 100 %), received into a preallocated buffer, and again
  into a fresh buffer per round (what ``recv_round`` without ``out`` does);
- dgt-p30: p = 30 % (top blocks by contribution over TCP, the rest over UDP), GSO/GRO on, then off;
- dgt-p30-stale: p = 30 % from a sender paced at a fixed ``--stale-pace`` (no congestion control, no send budget)
  to a receiver that closes each round 20 ms after its important blocks (``deadline="fixed:0.02"``): the datagrams
  still queued are abandoned. ``paced_send_seconds`` is what sending every unimportant byte at that pace would take,
  ``seconds_vs_paced_send`` the median round's time over it (below 1: the close did not wait for the pace), and as
  every round after the first starts while the sender may still hold the previous one's abandoned datagrams, the
  rounds' times also show whether a round waits behind a stale one.

Times run from the sender starting the round to the receiver holding the result (CLOCK_MONOTONIC is shared by the
two processes); MB/s = 1e6 bytes per second of the bucket's size; ratios are against the raw anchor.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time
import traceback
from typing import Any

import numpy as np
import torch
import trio

from dgt.cliargs import COUNT, FRACTION, POSITIVE, BadOption, integer
from dgt.errors import open_nursery

TOKEN = 0xD67B_E7C4


# ---------------------------------------------------------------------------------------------------- worker side
def _raw_listen(st: dict) -> int:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    st["raw_listener"] = ls
    return ls.getsockname()[1]


def _raw_recv(st: dict, nbytes: int, repeats: int) -> list[float]:
    conn, _ = st.pop("raw_listener").accept()
    buf = bytearray(nbytes)  # preallocated once, reused: the strictest anchor
    mv = memoryview(buf)
    ends, cpu = [], []
    with conn:
        for _ in range(repeats):
            got = 0
            c0 = None
            while got < nbytes:
                n = conn.recv_into(mv[got:])
                if n == 0:
                    raise ConnectionError("sender went away")
                got += n
                c0 = time.process_time() if c0 is None else c0
            ends.append(time.monotonic())
            cpu.append(time.process_time() - c0)
            conn.sendall(b"k")
    return {"t": ends, "cpu": cpu}


def _raw_send(st: dict, port: int, nbytes: int, repeats: int) -> list[float]:
    data = _payload(st, nbytes // 4).view(torch.uint8).numpy()
    starts, cpu = [], []
    with socket.create_connection(("127.0.0.1", port)) as s:
        for _ in range(repeats):
            starts.append(time.monotonic())
            c0 = time.process_time()
            s.sendall(data)
            cpu.append(time.process_time() - c0)
            if s.recv(1) != b"k":
                raise ConnectionError("receiver went away")
    return {"t": starts, "cpu": cpu}


def _ours_listen(st: dict) -> int:
    from dgt.channels.lanes import default_lanes
    from dgt.channels.tcp import TcpListener

    async def main():
        return TcpListener("127.0.0.1", default_lanes()[0])

    st["ours_listener"] = trio.run(main)
    return st["ours_listener"].port


def _ours_recv(st: dict, nbytes: int, repeats: int) -> list[float]:
    """Our reliable channel without the DGT round protocol: frames land straight in a preallocated buffer."""
    from dgt import wire
    from dgt.channels.framing import FrameReader
    from dgt.channels.lanes import default_lanes
    from dgt.channels.tcp import TcpChannel

    listener = st.pop("ours_listener")
    target = memoryview(bytearray(nbytes))

    async def main() -> list[float]:
        sock = await listener.accept()
        chan = TcpChannel(sock, default_lanes()[0])
        reader = FrameReader(chan, wire.DEFAULT_LIMITS, TOKEN)
        ends, cpu = [], []
        for _ in range(repeats):
            got = 0
            c0 = None
            while got < nbytes:
                rf = await reader.next(lambda h: target[int(h["offset"]) : int(h["offset"]) + int(h["length"])])
                got += int(rf.header["length"])
                c0 = time.process_time() if c0 is None else c0
            ends.append(time.monotonic())
            cpu.append(time.process_time() - c0)
            await chan.send_buffers([b"k"])
        chan.close()
        listener.close()
        return {"t": ends, "cpu": cpu}

    return trio.run(main)


def _ours_send(st: dict, port: int, nbytes: int, repeats: int, frame: int = 1 << 20) -> list[float]:
    from dgt import wire
    from dgt.channels.lanes import default_lanes
    from dgt.channels.tcp import TcpChannel, dial

    data = memoryview(_payload(st, nbytes // 4).view(torch.uint8).numpy())
    offs = list(range(0, nbytes, frame))
    hdrs = [wire.encode_header(wire.FrameType.DATA, token=TOKEN, rank=0, offset=o, dtype=wire.WireDType.UINT8,
                               count=min(frame, nbytes - o), length=min(frame, nbytes - o)) for o in offs]  # fmt: skip

    async def main() -> list[float]:
        lane = default_lanes()[0]
        chan = TcpChannel(await dial("127.0.0.1", port, lane, 10.0), lane)
        ack = memoryview(bytearray(1))
        starts, cpu = [], []
        for _ in range(repeats):
            starts.append(time.monotonic())
            c0 = time.process_time()
            for o, h in zip(offs, hdrs):
                await chan.send_buffers([h, data[o : o + frame]])
            cpu.append(time.process_time() - c0)
            await chan.recv_exactly(ack)
        chan.close()
        return {"t": starts, "cpu": cpu}

    return trio.run(main)


def _payload(st: dict, numel: int) -> torch.Tensor:
    if st.get("payload_n") != numel:
        g = torch.Generator().manual_seed(1234)
        st["payload"] = torch.randn(numel, generator=g)
        st["payload_n"] = numel
        st.pop("classes", None)
    return st["payload"]


def _classes(st: dict, x: torch.Tensor, layout: Any, p: float) -> tuple[Any, Any, int]:
    """The sender's lane classes and order for keeping ``p`` of the blocks (cached in ``st`` per p), and the bytes of
    its unimportant blocks."""
    from dgt.estimator import ContributionEstimator

    if st.get("classes", (None,))[0] != p:
        est = ContributionEstimator(layout)
        est.update(x)
        c = est.classify(p)
        st["classes"] = (p, c.cls, c.order)
    _, cls, order = st["classes"]
    return cls, order, int(layout.block_len[cls != 0].sum()) * x.element_size()


async def _send_one(ep: Any, peer: int, i: int, x: torch.Tensor, layout: Any, cls: Any,
                    order: Any) -> tuple[float, float, dict]:
    """Round ``i`` on the sending side, once the receiver says "go": (start time, CPU seconds, its SendStats)."""
    if await ep.inbound.recv_bytes(peer, timeout=60) != b"go":
        raise RuntimeError("bad go message")
    t = time.monotonic()
    c0 = time.process_time()
    row = (await ep.send_round(peer, 0, i, x, layout, cls, order)).to_dict()
    return t, time.process_time() - c0, row


async def _recv_one(ep: Any, peer: int, i: int, out: torch.Tensor | None, x: torch.Tensor,
                    p: float) -> tuple[float, float, dict]:
    """Round ``i`` on the receiving side: post recv_round, say "go", wait for it: (end time, CPU seconds, a row)."""
    async with open_nursery() as n:
        box: dict[str, Any] = {}

        async def recv() -> None:
            box["res"] = await ep.recv_round(peer, 0, i, out=out)
            box["t"] = time.monotonic()
            box["cpu"] = time.process_time()

        n.start_soon(recv)
        await trio.sleep(0.02)  # recv_round is registered (and out with it) before "go"
        await ep.outbound.send_bytes(peer, b"go")
        c0 = time.process_time()
    r = box.pop("res")
    row = {
        "received_fraction": float(r.mask.float().mean()), "closed_by": r.stats.closed_by,
        "deadline_wait": r.stats.deadline_wait, "dropped": r.stats.dropped,
        "exact": bool(torch.equal(r.data, x)) if p >= 1.0 else None,  # lossy: residual rides along
    }  # fmt: skip
    del r  # done with the result, as a training step is: its buffer can land a later round
    return box["t"], box["cpu"] - c0, row


def _dgt(st: dict, role: str, cfg: dict, numel: int, repeats: int, p: float = 1.0, use_out: bool = True) -> dict:
    """One variant on one side, natively in trio: open, trade addresses through the parent, connect, run rounds.
    The receiver posts recv_round (into ``out`` when use_out) and then says "go"; the sender starts its clock then.
    ``cfg``: TransportConfig's keywords, each group a dict of its fields."""
    from dgt.layout import BucketLayout
    from dgt.transport import Endpoint, PeerAddress, TransportConfig

    conn = st["conn"]
    rank, peer = (0, 1) if role == "send" else (1, 0)
    x = _payload(st, numel)
    layout = BucketLayout.flat(numel)
    cls, order, unimportant_bytes = _classes(st, x, layout, p) if role == "send" and p < 1.0 else (0, None, 0)
    out = torch.empty(numel) if use_out else None
    if out is not None:
        out.view(torch.uint8).numpy()[::4096] = 0  # fault the pages in once, as the raw anchor's buffer is

    async def main() -> dict:
        async with Endpoint.open(rank, TOKEN, TransportConfig(**cfg)) as ep:
            conn.send(("addr", ep.address.to_dict()))
            other = await trio.to_thread.run_sync(conn.recv)
            await ep.connect({peer: PeerAddress.from_dict(other)})
            times, cpu, rows = [], [], []
            for i in range(repeats):
                if role == "send":
                    t, used, row = await _send_one(ep, peer, i, x, layout, cls, order)
                else:
                    t, used, row = await _recv_one(ep, peer, i, out, x, p)
                times.append(t)
                cpu.append(used)
                rows.append(row)
            # the receiver stays until the sender's last round has returned: closing at once would fail the
            # datagrams the sender still holds of that round, uncounted, instead of abandoning them (counted)
            if role == "send":
                await ep.outbound.send_bytes(peer, b"done")
            elif await ep.inbound.recv_bytes(peer, timeout=60) != b"done":
                raise RuntimeError("bad done message")
            return {"t": times, "cpu": cpu, "rows": rows, "stats": ep.stats().to_dict(),
                    "unimportant_bytes": unimportant_bytes}

    return trio.run(main)


HANDLERS = {f.__name__[1:]: f for f in (_raw_listen, _raw_recv, _raw_send, _ours_listen, _ours_recv, _ours_send, _dgt)}


def worker(conn) -> None:
    """Serve commands from the parent until 'exit' (each: name, kwargs -> ('ok', result) or ('err', text))."""
    torch.set_num_threads(1)
    st: dict[str, Any] = {"conn": conn}
    while True:
        name, kw = conn.recv()
        if name == "exit":
            break
        try:
            conn.send(("ok", HANDLERS[name](st, **kw)))
        except BaseException:
            conn.send(("err", traceback.format_exc()))


# ---------------------------------------------------------------------------------------------------- parent side
class _Pair:
    """Two worker processes (0 sends, 1 receives), killed in any case on exit."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(2):
            a, b = ctx.Pipe()
            p = ctx.Process(target=worker, args=(b,), daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)

    def call(self, who: int, name: str, timeout: float = 300, **kw) -> Any:
        self.post(who, name, **kw)
        return self.result(who, timeout)

    def post(self, who: int, name: str, **kw) -> None:
        self.conns[who].send((name, kw))

    def result(self, who: int, timeout: float = 300) -> Any:
        if not self.conns[who].poll(timeout):
            raise TimeoutError(f"worker {who} did not answer within {timeout} s")
        status, val = self.conns[who].recv()
        if status == "err":
            raise RuntimeError(f"worker {who} failed:\n{val}")
        return val

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("exit", {}))
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


def _rates(nbytes: int, starts: list[float], ends: list[float], cpu_send: list[float], cpu_recv: list[float]) -> dict:
    """Wall-clock rates, plus the CPU seconds each side spent (a shared machine inflates wall time, not CPU)."""
    secs = [e - s for s, e in zip(starts, ends)]
    mbps = [nbytes / 1e6 / t for t in secs]
    return {
        "seconds": secs, "mb_s": mbps, "mb_s_median": statistics.median(mbps), "mb_s_best": max(mbps),
        "cpu_ms_send_median": 1e3 * statistics.median(cpu_send),
        "cpu_ms_recv_median": 1e3 * statistics.median(cpu_recv),
    }  # fmt: skip


def _socket_pair_run(pair: _Pair, kind: str, nbytes: int, repeats: int) -> dict:
    port = pair.call(1, f"{kind}_listen")
    pair.post(1, f"{kind}_recv", nbytes=nbytes, repeats=repeats)
    sent = pair.call(0, f"{kind}_send", port=port, nbytes=nbytes, repeats=repeats)
    got = pair.result(1)
    return _rates(nbytes, sent["t"], got["t"], sent["cpu"], got["cpu"])


def _dgt_run(pair: _Pair, cfg: dict, numel: int, p: float, repeats: int, use_out: bool,
             recv_cfg: dict | None = None) -> dict:
    """One DGT variant: ``cfg`` for both endpoints, or for the sender only when ``recv_cfg`` is given."""
    for who, role, c in ((0, "send", cfg), (1, "recv", cfg if recv_cfg is None else recv_cfg)):
        pair.post(who, "dgt", role=role, cfg=c, numel=numel, repeats=repeats, p=p, use_out=use_out)
    addrs = [pair.result(who) for who in (0, 1)]  # each side's ("addr", ...) message comes first
    pair.conns[0].send(addrs[1])
    pair.conns[1].send(addrs[0])
    sent, got = pair.result(0), pair.result(1)
    out = _rates(numel * 4, sent["t"], got["t"], sent["cpu"], got["cpu"])
    last = sent["rows"][-1]
    rows = got["rows"]
    out.update(
        received_fraction=[r["received_fraction"] for r in rows],
        closed_by=[r["closed_by"] for r in rows],
        deadline_wait=[r["deadline_wait"] for r in rows],
        lossless_exact=rows[-1]["exact"],
        important_blocks=last["important_blocks"],
        unimportant_blocks=last["unimportant_blocks"],
        datagrams=last["datagrams"],
        abandoned=last["abandoned"],
        abandoned_per_round=[sum(s["abandoned"].values()) for s in sent["rows"]],
        unimportant_bytes=sent["unimportant_bytes"],
        lost_blocks=[s["lost_blocks"] for s in sent["rows"]],
        unsent_blocks=[s.get("unsent_blocks", 0) for s in sent["rows"]],
        pace_rate=[s.get("pace_rate") for s in sent["rows"]],
        udp_lanes={ln["lane"]: {k: ln[k] for k in ("gso", "gro", "rx_frames", "rx_calls", "rx_gro_reads",
                                                   "rx_kernel_drops", "rcvbuf")}
                   for ln in got["stats"]["lanes"] if ln["kind"] == "udp"},  # fmt: skip
    )
    return out


def _merged(base: dict, more: dict) -> dict:
    """``base`` with ``more``'s settings: a TransportConfig's keywords, each group a dict of its fields."""
    return base | {k: base.get(k, {}) | v if isinstance(v, dict) else v for k, v in more.items()}


def _stale_run(pair: _Pair, base: dict, numel: int, p: float, repeats: int, pace: float) -> dict:
    """dgt-p30-stale: a fixed-pace sender (no congestion control, so no send budget: every unimportant block is
    planned as a datagram) to a receiver closing each round 20 ms after its important blocks."""
    sender = _merged(base, {"congestion": {"enabled": False}, "pacing": {"rate": pace, "burst": 16 << 10}})
    out = _dgt_run(pair, sender, numel, p, repeats, True, recv_cfg=base | {"deadline": "fixed:0.02"})
    paced = out["unimportant_bytes"] / pace
    med = statistics.median(out["seconds"])
    out.update(pace_rate_fixed=pace, paced_send_seconds=paced, seconds_median=med,
               seconds_vs_paced_send=med / paced if paced > 0 else None)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mb", type=POSITIVE, default=100.0, help="bucket size in MB (1e6 bytes; float32)")
    parser.add_argument("--repeats", type=COUNT, default=10,
                        help="rounds per variant (median and best reported; default 10: the lossy variants' "
                             "congestion controller starts each endpoint pair at its start rate and needs a few rounds "
                             "to reach the path's rate, so a median over 3 rounds measures that warm-up, not a "
                             "training run)")
    parser.add_argument("--p", type=FRACTION, default=0.3, help="fraction of important blocks for the lossy variant")
    parser.add_argument("--datagram-payload", type=integer(16, 65000), default=None,
                        help="UDP payload bytes per datagram (default: the transport's, sized by the route's MTU: "
                             "65000 over loopback, so a 4 KiB block is one datagram; 1400 is what fits Ethernet)")
    parser.add_argument("--quick", action="store_true", help="skip the GSO-off and fresh-buffer variants")
    parser.add_argument("--no-datagram-mac", action="store_true",
                        help="DGT variants without the datagram MAC (datagram_mac=False), to measure it")
    parser.add_argument("--stale-pace", type=POSITIVE, default=1e6,
                        help="bytes/s of the dgt-p30-stale variant's paced sender (default 1e6: far below what the "
                             "round's unimportant bytes need to arrive before the receiver's 20 ms deadline)")
    parser.add_argument("--variants", default="", help="comma-separated DGT variants to run (default: all; the raw "
                        f"anchor always runs): {', '.join(DGT_VARIANTS)}")


DGT_VARIANTS = ("tcp-ours", "dgt-lossless", "dgt-lossless-fresh", "dgt-p30-gso", "dgt-p30-gso-nocc", "dgt-p30-nogso",
                "dgt-p30-stale")


def _wanted(args: argparse.Namespace) -> set[str]:
    if getattr(args, "variants", ""):
        want = {v.strip() for v in args.variants.split(",") if v.strip()}
        bad = want - set(DGT_VARIANTS)
        if bad:
            raise BadOption(f"--variants: unknown {sorted(bad)}; choose from {', '.join(DGT_VARIANTS)}")
        return want
    return {"tcp-ours", "dgt-lossless", "dgt-p30-gso", "dgt-p30-gso-nocc"} if args.quick else set(DGT_VARIANTS)


def run(args: argparse.Namespace) -> dict:
    numel = int(args.mb * 1e6) // 4
    if numel < 1:
        raise BadOption(f"--mb {args.mb}: less than one float32")
    nbytes = numel * 4
    reps = args.repeats
    base = {"timeouts": {"peer": 30.0}, "lanes": {"datagram_payload": args.datagram_payload},
            "security": {"datagram_mac": not getattr(args, "no_datagram_mac", False)}}
    want = _wanted(args)  # a bad --variants fails before any process starts
    stale_pace = float(getattr(args, "stale_pace", 1e6))
    if not stale_pace > 0:
        raise BadOption(f"--stale-pace must be positive bytes/s, not {stale_pace}")
    pair = _Pair()
    t0 = time.perf_counter()
    try:
        res: dict[str, Any] = {}
        res["raw"] = _socket_pair_run(pair, "raw", nbytes, reps)
        if "tcp-ours" in want:
            res["tcp-ours"] = _socket_pair_run(pair, "ours", nbytes, reps)
        if "dgt-lossless" in want:
            res["dgt-lossless"] = _dgt_run(pair, base, numel, 1.0, reps, use_out=True)
        if "dgt-lossless-fresh" in want:
            res["dgt-lossless-fresh"] = _dgt_run(pair, base, numel, 1.0, reps, use_out=False)
        if "dgt-p30-gso" in want:
            res["dgt-p30-gso"] = _dgt_run(pair, base, numel, args.p, reps, use_out=True)
        if "dgt-p30-gso-nocc" in want:  # the same without congestion control and send budget (all sent, unpaced)
            res["dgt-p30-gso-nocc"] = _dgt_run(pair, _merged(base, {"congestion": {"enabled": False}}), numel, args.p,
                                               reps, True)
        if "dgt-p30-nogso" in want:
            res["dgt-p30-nogso"] = _dgt_run(pair, _merged(base, {"sockets": {"gso": False, "gro": False}}), numel,
                                            args.p, reps, True)
        if "dgt-p30-stale" in want:
            res["dgt-p30-stale"] = _stale_run(pair, base, numel, args.p, reps, stale_pace)
    finally:
        pair.close()
    anchor = res["raw"]["mb_s_median"]
    ratios = {k: v["mb_s_median"] / anchor for k, v in res.items()}
    return {
        "bench": "transport",
        "bytes": nbytes,
        "repeats": reps,
        "p": args.p,
        "datagram_payload": args.datagram_payload,
        "datagram_mac": base["security"]["datagram_mac"],
        "cpus": os.cpu_count(),
        "mb_s_median": {k: v["mb_s_median"] for k, v in res.items()},
        "ratio_vs_raw": ratios,
        "cpu_ms_per_round": {k: {"send": v["cpu_ms_send_median"], "recv": v["cpu_ms_recv_median"]}
                             for k, v in res.items()},  # fmt: skip
        "load_average": os.getloadavg(),
        "goal_lossless_ge_0.8x_raw": ratios["dgt-lossless"] >= 0.8 if "dgt-lossless" in ratios else None,
        "gso": {"on": res.get("dgt-p30-gso", {}).get("udp_lanes"),
                "off": res.get("dgt-p30-nogso", {}).get("udp_lanes")},
        "stale_round": None if "dgt-p30-stale" not in res else {
            k: res["dgt-p30-stale"][k] for k in ("pace_rate_fixed", "paced_send_seconds", "seconds_median",
                                                  "seconds_vs_paced_send", "abandoned_per_round", "closed_by")},
        "variants": res,
        "wall_seconds": time.perf_counter() - t0,
        "numpy": np.__version__,
    }
