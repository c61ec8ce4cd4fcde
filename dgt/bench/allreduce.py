"""``dgt bench allreduce``: DGT ring and parameter-server all-reduce against torch.distributed Gloo all_reduce on the
same tensor and ranks, in the same run (each rank times both; a Gloo barrier aligns the ranks before every trial;
the methods take turns, trial by trial, in a rotating order).
Only the all-reduce is timed: Gloo reduces a result buffer in place, so the input is copied into it before the
barrier, outside the timed part; ours reads the input and writes the same buffer (``out=``), which needs no copy.
Both reuse one buffer allocated once, so neither pays for faulting in a new 25 MB tensor per trial."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from functools import partial
from typing import TYPE_CHECKING, Any

from dgt.cliargs import COUNT, FRACTION, POSITIVE, BadOption, codec_spec, integer
from dgt.collectives.launch import run_ranks

if TYPE_CHECKING:
    from dgt.transport.stats import TransportStats


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=integer(2), default=2,
                   help="number of ranks (processes on this machine), each with an equal share of this machine's "
                   "cores as torch threads (the DGT_THREADS environment variable overrides: the threads a lossy hop's "
                   "C passes may use)")
    p.add_argument("--mb", type=POSITIVE, default=25.0, help="tensor size in MB of fp32")
    p.add_argument("--repeat", type=COUNT, default=5, help="timed trials per method (the best and the median are "
                   "reported, each trial timed by its slowest rank; per_trial lists every trial with its CPU ms per "
                   "rank and, for DGT, the datagrams sent, blocks kept back and lost, and deadline waits)")
    p.add_argument("--codec", action="append", default=None,
                   help="codec for the DGT collectives (dense = lossless; the default). Repeat it to time each "
                   "collective once per codec in the same run, trial by trial, as ring[dense], ring[dgt:p=0.3]...: "
                   "vs_first_codec then gives each one's time relative to the same collective with the first codec "
                   "(--codec dense --codec dgt:p=0.3: the lossy ring against the lossless ring)")
    p.add_argument("--stream-hops", default="auto", choices=["auto", "native", "python", "off"],
                   help="how the lossless ring's hops run: on stream lanes with the native loop (auto: when built) or "
                   "its Python twin, or off: on the session link (see docs/transport.md)")
    p.add_argument("--collectives", default="ring,ps_sharded,ps_central",
                   help="comma-separated DGT collectives to time against Gloo: ring, ps_sharded, ps_central, "
                        "direct (the transpose all-reduce: two rounds whatever the world size)")
    p.add_argument("--hop-threads", default="0",
                   help="threads per native ring hop: 0 auto, 1, 2 (send half on its own thread); a list such as 1,2 "
                   "times the ring once per value in the same run, as ring/1t, ring/2t")
    p.add_argument("--cpu-gate", type=FRACTION, default=None,
                   help="TransportConfig.cpu_gate for the DGT groups (default: its own, 0.1): a lossy ring hop sends "
                   "no unimportant datagram while its transfer thread waits for a CPU more than this fraction of the "
                   "time; 0 switches the gate off (what the datagram path costs this host)")
    p.add_argument("--timeout", type=POSITIVE, default=300.0)


COLLECTIVES = ("ring", "ps_sharded", "ps_central")
CHOICES = (*COLLECTIVES, "direct")  # direct: opt-in (not in the default list)


class _Trials:
    """One rank's timed trials and what they record: per method, seconds, CPU seconds and unreliable-lane counters
    per trial, and the largest difference from Gloo's sum. ``y`` is the buffer every method writes its sum into."""

    def __init__(self, y: Any, repeat: int) -> None:
        self.y, self.repeat = y, repeat
        self.ref = y.new_empty(y.shape)  # Gloo's sum: each of ours must agree with it (to float rounding)
        self.out: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}  # per trial: this process's CPU seconds (every thread, kernel time too)
        self.udp: dict[str, list[list[float]]] = {}  # per trial: the unreliable-lane counters it moved (_udp_now)
        self.snap: Callable[[], list[float]] | None = None  # reads those counters (set once the groups are open)
        self.diffs: dict[str, float] = {}

    def run(self, methods: dict, barrier: Callable[[], Any]) -> None:
        """Trial i of every method before trial i + 1 of any, so a drift in the machine's speed (other tenants, CPU
        steal) reaches every method alike; the order rotates every round, so each method follows every other one
        equally often (whatever a method leaves running in the background slows the next). Round 0 warms up, Gloo
        first, and is not counted; its Gloo sum is the reference the others must match (the input never changes)."""
        names = list(methods)
        for i in range(self.repeat + 1):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                fn, prep = methods[name]
                prep()
                barrier()
                elapsed, used, moved = _timed(fn, self.snap)
                if i:
                    self.out.setdefault(name, []).append(elapsed)
                    self.cpu.setdefault(name, []).append(used)
                    if moved is not None:
                        self.udp.setdefault(name, []).append(moved)
                self._check(name, i)

    def _check(self, name: str, i: int) -> None:
        if name == "gloo" and i == 0:
            self.ref.copy_(self.y)
        elif name != "gloo":  # the largest over trials; a NaN (a part never written) stays
            d, prev = float((self.y - self.ref).abs().max()), self.diffs.get(name, 0.0)
            self.diffs[name] = d if d != d or d > prev else prev


def _bench_config(stream_hops: str, threads: int, cpu_gate: float | None) -> Any:
    from dgt.transport import Congestion, Hops, TransportConfig

    congestion = {} if cpu_gate is None else {"congestion": Congestion(cpu_gate=cpu_gate)}
    return TransportConfig(hops=Hops(mode=stream_hops, threads=threads), **congestion)


def _rank(rank: int, world: int, numel: int, repeat: int, codecs: tuple[str, ...], stream_hops: str = "auto",
          collectives: tuple[str, ...] = COLLECTIVES, hop_threads: tuple[int, ...] = (0,),
          cpu_gate: float | None = None) -> dict:
    import torch
    import torch.distributed as dist
    import trio

    from dgt.collectives import Group

    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    store = dist.distributed_c10d._get_default_store()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    y = torch.empty_like(x)  # every method writes the sum into this buffer, reused across trials
    rec = _Trials(y, repeat)
    transport: dict = {}

    async def dgt_part():
        async with AsyncExitStack() as stack:  # the groups, closed in reverse order on the way out
            groups = {t: await stack.enter_async_context(Group.open(
                          rank, world, store=store, prefix=f"bench-allreduce-{t}", timeout=60,
                          config=_bench_config(stream_hops, t, cpu_gate)))
                      for t in hop_threads}  # fmt: skip
            portal = trio.lowlevel.current_trio_token()
            eps = [gr.endpoint for gr in groups.values()]
            rec.snap = lambda: trio.from_thread.run_sync(_udp_now, eps, trio_token=portal)

            def call(coll, bucket):
                trio.from_thread.run(partial(coll.allreduce, x, bucket, None, out=y), trio_token=portal)

            def poison():
                y.fill_(float("nan"))  # a method that left part of the buffer unwritten shows up as NaN

            methods = {"gloo": (partial(dist.all_reduce, y), partial(y.copy_, x))}
            for name, (coll, bucket) in _collectives(groups, codecs, collectives).items():
                methods[name] = (partial(call, coll, bucket), poison)
            await trio.to_thread.run_sync(rec.run, methods, dist.barrier)
            transport.update(_lane_summary(groups[hop_threads[0]].endpoint.stats()))

    trio.run(dgt_part)
    dist.barrier()
    dist.destroy_process_group()
    return {"seconds": rec.out, "cpu": rec.cpu, "udp": rec.udp, "max_abs_diff": rec.diffs,
            "scale": float(rec.ref.abs().max()), "transport": transport}


def _collectives(groups: dict, codecs: tuple[str, ...], collectives: tuple[str, ...]) -> dict:
    """The DGT collectives to time, by report key, each with its bucket id: each of ``collectives`` once per codec,
    on the first group; the ring once per group (hop-thread count) when there are several. A bucket id per codec: the
    transport keeps error feedback per key, and a lossless call on a key after lossy ones would deliver what they
    kept back (the direct all-reduce's session-link posts) instead of this trial's sum."""
    from dgt.collectives import DirectAllReduce, ParameterServer, RingAllReduce

    g = next(iter(groups.values()))
    make = {"ring": lambda c: RingAllReduce(g, c, op="sum"),
            "ps_sharded": lambda c: ParameterServer(g, c, op="sum", server="sharded"),
            "ps_central": lambda c: ParameterServer(g, c, op="sum", server=0),
            "direct": lambda c: DirectAllReduce(g, c, op="sum")}
    out = {}
    for bucket, codec in enumerate(codecs):
        for name in collectives:
            if name == "ring" and len(groups) > 1:
                for t, gt in groups.items():
                    out[method_name(f"ring/{t}t", codec, codecs)] = (RingAllReduce(gt, codec, op="sum"), bucket)
            else:
                out[method_name(name, codec, codecs)] = (make[name](codec), bucket)
    return out


def method_name(name: str, codec: str, codecs: tuple[str, ...]) -> str:
    """A DGT method's key in the report: the collective's name, with ``[codec]`` when several codecs are timed."""
    return name if len(codecs) == 1 else f"{name}[{codec}]"


UDP_FIELDS = ("datagrams", "unsent_blocks", "lost_blocks", "deadline_wait_s", "cpu_gated_rounds")


def _timed(fn: Callable[[], object], snap: Callable[[], list[float]] | None) -> tuple[float, float, list[float] | None]:
    """``fn()``'s wall seconds, this process's CPU seconds over it, and the unreliable-lane counters it moved
    (``snap`` reads them: :func:`_udp_now`; None without one)."""
    before = None if snap is None else snap()
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    elapsed, used = time.perf_counter() - t0, time.process_time() - c0
    return elapsed, used, None if snap is None or before is None else [a - b for a, b in zip(snap(), before)]


def _udp_now(endpoints: list) -> list[float]:
    """The counters of ``UDP_FIELDS`` over the endpoints' unreliable lanes, as of now (per trial: the difference)."""
    keys = ("udp_datagrams_sent", "unsent_blocks", "lost_blocks", "deadline_wait_total", "cpu_gated_rounds")
    sums = [_lane_summary(ep.stats()) for ep in endpoints]
    return [float(sum(s[k] for s in sums)) for k in keys]


def _per_trial(res: dict, name: str) -> list[dict]:
    """Trial by trial: the slowest rank's seconds, the mean CPU milliseconds per rank, and the unreliable lanes'
    counters summed over ranks (datagrams sent, blocks kept back by the send budget, blocks lost, seconds receivers
    held rounds open after their important blocks, lossy ring hops the CPU gate kept from sending datagrams): what
    makes one trial slower than another."""
    ranks = [res[r] for r in sorted(res)]
    rows = []
    for i, secs in enumerate(zip(*(r["seconds"][name] for r in ranks))):
        row = {"seconds": max(secs), "cpu_ms_per_rank": 1e3 * sum(r["cpu"][name][i] for r in ranks) / len(ranks)}
        if all(name in r["udp"] for r in ranks):
            for j, f in enumerate(UDP_FIELDS):
                v = sum(r["udp"][name][i][j] for r in ranks)
                row[f] = v if f == "deadline_wait_s" else int(v)
        rows.append(row)
    return rows


def _lane_summary(st: TransportStats) -> dict:
    """What one rank's unreliable lanes did over every trial: datagrams handed to the kernel, abandoned (their
    round had closed), unimportant blocks kept back by the send budget (unsent) and reported missing (lost), and
    the congestion controller's final rate per peer (bytes/s); of the rounds it received, how each closed and how
    long it held them open after their important blocks were in (deadline waits, seconds); the lossy ring hops the
    CPU gate kept from sending datagrams (``cpu_gated_rounds``) and its last reading (``cpu_wait``: the fraction of
    a hop's transfer its thread waited for a CPU, averaged; dgt.protocol.cpu_gate)."""
    udp = [ln for ln in st.lanes if ln.kind == "udp"]
    return {"udp_datagrams_sent": sum(ln.tx_frames for ln in udp),
            "udp_abandoned": sum(ln.tx_abandoned for ln in udp),
            "unsent_blocks": sum(ln.tx_unsent_blocks for ln in udp),
            "lost_blocks": sum(ln.tx_lost_blocks for ln in udp),
            "delivered_blocks": sum(ln.delivered_blocks for ln in udp),
            "pace_rates": {str(k): v for k, v in st.pace_rates.items()},
            "closed_by": dict(st.closed_by), "deadline_wait_total": st.deadline_wait_total,
            "cpu_gated_rounds": st.rounds_cpu_gated, "cpu_wait": st.cpu_wait}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    numel = int(args.mb * 1e6 / 4)
    hops = getattr(args, "stream_hops", "auto")
    colls = tuple(c.strip() for c in getattr(args, "collectives", ",".join(COLLECTIVES)).split(",") if c.strip())
    unknown = sorted(set(colls) - set(CHOICES))
    if unknown or not colls:
        raise BadOption(f"--collectives: unknown {unknown}; choose from {', '.join(CHOICES)}")
    try:
        threads = tuple(dict.fromkeys(int(t) for t in str(getattr(args, "hop_threads", "0")).split(",")))
    except ValueError:
        raise BadOption("--hop-threads: comma-separated values out of 0, 1, 2") from None
    if not threads or set(threads) - {0, 1, 2}:
        raise BadOption("--hop-threads: comma-separated values out of 0, 1, 2")
    codecs = tuple(codec_spec("--codec", c) for c in _codecs(getattr(args, "codec", None)))
    gate = getattr(args, "cpu_gate", None)
    if gate is not None and not 0.0 <= gate <= 1.0:
        raise BadOption("--cpu-gate: a fraction in [0, 1] (0: off)")
    res = run_ranks(_rank, args.ranks, numel, args.repeat, codecs, hops, colls, threads, gate, timeout=args.timeout)
    # a collective ends when its slowest rank does: per trial the slowest rank's time, then the best and the median
    trials = {k: [max(t) for t in zip(*(r["seconds"][k] for r in res.values()))] for k in res[0]["seconds"]}
    best = {k: min(v) for k, v in trials.items()}
    median = {k: statistics.median(v) for k, v in trials.items()}
    out = {"bench": "allreduce", "ranks": args.ranks, "mb": args.mb,
           "codec": codecs[0] if len(codecs) == 1 else list(codecs), "repeat": args.repeat, "cpu_gate": gate,
           "seconds": best, "median_seconds": median}  # fmt: skip
    if len(codecs) > 1:
        out["vs_first_codec"] = _vs_first(best, median, codecs)
        rings = {k: v["best"] for k, v in out["vs_first_codec"].items() if k.startswith("ring[")}
        if codecs[0] == "dense" and rings:  # issue 26: a lossy ring within 1.5x of the lossless ring's time
            out["lossy_goal"] = "each lossy ring's best time within 1.5x of the lossless ring's (ring[dense])"
            out["lossy_goal_met"] = all(v <= 1.5 for v in rings.values())
    per_trial = {k: _per_trial(res, k) for k in res[0]["seconds"]}
    out["cpu_ms_per_rank_median"] = {k: statistics.median(t["cpu_ms_per_rank"] for t in v)
                                     for k, v in per_trial.items()}  # fmt: skip
    out["per_trial"] = per_trial
    from dgt.transport import Hops, TransportConfig

    cfg = TransportConfig(hops=Hops(mode=hops, threads=threads[0]))
    out["ring_hops"] = ("session link" if hops == "off" else "python loop" if not cfg.native_hops() else
                        f"native loop, {cfg.hop_thread_count()} thread(s)" if len(threads) == 1 else
                        f"native loop, {'/'.join(str(t) for t in threads)} thread(s)")
    # largest difference from Gloo's sum on any rank, relative to the sum's magnitude (NaN: a part never written)
    out["transport"] = {str(r): res[r].get("transport", {}) for r in sorted(res)}  # per rank, over all trials
    out["max_rel_diff_vs_gloo"] = {k: max(r["max_abs_diff"][k] / max(r["scale"], 1e-30) for r in res.values())
                                   for k in res[0]["max_abs_diff"]}  # fmt: skip
    out["speed_vs_gloo"] = {k: best["gloo"] / v for k, v in best.items() if k != "gloo"}  # best trial vs best
    out["median_speed_vs_gloo"] = {k: median["gloo"] / v for k, v in median.items() if k != "gloo"}
    if "ring" in best:  # one codec: the ring's own key
        ring = "lossless DGT ring" if codecs == ("dense",) else f"DGT ring ({codecs[0]})"
        out["goal"] = f"{ring} >= 1.0x Gloo: {args.mb:g} MB at {args.ranks} ranks (this run)"
        out["goal_met"] = out["speed_vs_gloo"]["ring"] >= 1.0
    return out


def _codecs(spec: str | list[str] | None) -> tuple[str, ...]:
    """``--codec`` as given: one spec (a string), a list of them (repeated), or none (dense); duplicates dropped."""
    given = [spec] if isinstance(spec, str) else list(spec or ["dense"])
    return tuple(dict.fromkeys(given))


def _vs_first(best: dict[str, float], median: dict[str, float], codecs: tuple[str, ...]) -> dict[str, dict]:
    """Per DGT method timed with a codec after the first: its best and median time over the same collective's with
    the first codec, from the same run (``ring[dgt:p=0.3]`` over ``ring[dense]``: above 1, slower)."""
    out = {}
    suffix = f"[{codecs[0]}]"
    for k in best:
        if k == "gloo" or k.endswith(suffix):
            continue
        base = k[: k.index("[")] + suffix
        out[k] = {"best": best[k] / best[base], "median": median[k] / median[base]}
    return out
