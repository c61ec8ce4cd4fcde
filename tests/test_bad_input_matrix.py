"""Bad input never hangs and never crashes a collective (issue 45), as two matrices run on in-process groups (every
rank an endpoint on loopback in one trio run), each case under a hard time bound:

- ranks that disagree (collective x codec x what they disagree on x stream lanes on/off x world): every rank raises
  the same :class:`RankMismatch` within ``peer_timeout``. Before: a float32/float64 pair on the lossy ring hung one
  rank (> 60 s) and timed the other out; gossip raised a RuntimeError for another size and returned an answer for
  another dtype or codec.
- tensors of any layout the API accepts (collective x codec x layout, in place or not): the result equals the
  reference, in the caller's shape and dtype, written back into the caller's tensor when it is the output; what
  cannot be reduced is refused with :class:`InputRejected` naming the requirement. Before: a strided view crashed the
  lossy ring with a ValueError, and a non-contiguous ``out`` was refused with one.
"""

import time

import pytest
import torch
import torch.distributed as dist
import trio

from dgt.codecs.base import BucketState
from dgt.codecs.lowrank import LowRankCodec, reduce_in_process, set_shapes
from dgt.collectives import DirectAllReduce, Gossip, Group, ParameterServer, RingAllReduce
from dgt.collectives.lowrank import LowRankAllReduce
from dgt.collectives.model_server import ModelServer
from dgt.errors import DgtError, InputRejected, RankMismatch
from dgt.harness.groups import local_groups
from dgt.harness.offline import OfflineTransport
from dgt.layout import DEFAULT_BLOCK
from dgt.transport import Congestion, Hops, Timeouts, TransportConfig

PEER_TIMEOUT = 4.0
BOUND = 2 * PEER_TIMEOUT + 5  # the whole case, group setup included: a hang fails here, it never blocks the suite
COLLECTIVES = ["ring", "ps", "ps-sharded", "gossip", "direct"]


def _build(kind, g, codec, op="sum"):
    if kind == "lowrank":  # another codec than lowrank: that rank calls the plain ring (it was configured so)
        return LowRankAllReduce(g, codec, op=op) if codec.startswith("lowrank") else RingAllReduce(g, codec, op=op)
    if kind == "ring":
        return RingAllReduce(g, codec, op=op)
    if kind == "direct":
        return DirectAllReduce(g, codec, op=op)
    if kind == "gossip":
        return Gossip(g, codec)
    return ParameterServer(g, codec, op=op, server="sharded" if kind == "ps-sharded" else 0)


def _shapes(x):
    """The tensors a low-rank call's bucket holds: a 50 x 100 matrix (sent as factors) and the rest 1-D (dense)."""
    n = x.numel()
    return [(50, 100), (n - 5000,)] if n >= 5000 else [tuple(x.shape)]


async def _call(kind, coll, x, out=None):
    if kind == "gossip":
        return await coll.mix(x)
    if isinstance(coll, LowRankAllReduce):
        assert out is None  # the low-rank all-reduce has no out
        return await coll.allreduce(x, 0, _shapes(x))
    return await coll.allreduce(x) if out is None else await coll.allreduce(x, out=out)


async def _on_every_rank(world, streams, fn, **config):
    """``fn(rank, group)`` on every rank of a fresh in-process group at once; per rank (outcome, seconds)."""
    cfg = TransportConfig(timeouts=Timeouts(peer=PEER_TIMEOUT), hops=Hops(mode=streams),
                          congestion=Congestion(cpu_gate=0.0), **config)
    out = [None] * world
    with trio.fail_after(BOUND):
        async with local_groups(world, dist.HashStore(), config=cfg, timeout=BOUND, prefix="m") as groups:

            async def one(r):
                t0 = time.monotonic()
                try:
                    out[r] = (await fn(r, groups[r]), time.monotonic() - t0)
                except DgtError as exc:
                    out[r] = (exc, time.monotonic() - t0)

            async with trio.open_nursery() as n:
                for r in range(world):
                    n.start_soon(one, r)
    return out


# -- ranks that disagree --------------------------------------------------------------------------------------------

REASONS = {  # what each disagreement may be reported as (the path differs when a dtype or codec changes it)
    "numel": ("different sizes or dtypes",),
    "dtype": ("different sizes or dtypes", "take different paths"),
    "op": ("different ops (mean / sum)",),
    "codec": ("different codecs (", "take different paths"),
}


def _mismatch_cases():
    for streams, worlds in (("auto", (2, 3)), ("off", (2,))):
        for world in worlds:
            for kind in COLLECTIVES:
                if kind == "gossip" and streams == "off":
                    continue  # gossip has no stream path: the auto cases cover it
                for codec in ("dense", "dgt:p=0.3"):
                    for what in REASONS:
                        if kind == "gossip" and what == "op":
                            continue  # gossip has no op (it mixes)
                        yield pytest.param(kind, codec, what, streams, world, 1,
                                           id=f"{kind}-{codec}-{what}-{streams}-w{world}")
    for codec in ("dense", "dgt:p=0.3"):  # the odd one out is the central server (it only receives first)
        for what in REASONS:
            yield pytest.param("ps", codec, what, "auto", 3, 0, id=f"ps-server-{codec}-{what}")
    # codecs that are not summable (gather-then-reduce; the ring refuses them at construction): sizes and dtypes are
    # seen when a peer's message does not decode into this rank's tensor (each message names its bucket's dtype).
    # Before: a float32/float64 pair returned on every rank, each rank's answer in its own dtype
    for kind in ("ps", "ps-sharded", "gossip"):
        for codec in ("qsgd", "olandraj"):
            for what in REASONS:
                if kind == "gossip" and what == "op":
                    continue
                yield pytest.param(kind, codec, what, "auto", 3, 1, id=f"{kind}-{codec}-{what}-auto-w3")


    # the low-rank all-reduce (three rings: P factors, Q factors and 1-D tensors, [residual]); its op and codec ride in
    # every frame of the three; "another codec": that rank calls the plain dense ring on the same tensor
    for world in (2, 3):
        for what in REASONS:
            yield pytest.param("lowrank", "lowrank", what, "auto", world, 1, id=f"lowrank-{what}-auto-w{world}")
    for what in REASONS:  # with the residual on the droppable lane (a third, lossy ring); another codec: lowrank
        yield pytest.param("lowrank", "lowrank:residual_p=0.5", what, "auto", 2, 1, id=f"lowrank+dgt-{what}-auto-w2")
    # the model server (Slim-DP's server that holds the model; no op: it applies lr * the sum): the numel and dtype
    # of the model, and the push codec; the odd one out a worker, or the server itself
    for codec in ("dense", "qsgd", "olandraj", "slimdp:alpha=0.3,eps=0.15,q=3"):
        for what in ("numel", "dtype", "codec"):
            for odd in (1, 0):
                yield pytest.param("model-server", codec, what, "auto", 2, odd,
                                   id=f"model-server-{codec.split(':')[0]}-{what}-odd{odd}")


def _small_mismatch_cases():
    """A bucket of fewer than W blocks (empty chunks: a rank's first hop may send nothing). Before: a float32 /
    float64 pair on the dense ring at 3 ranks (and the low-rank all-reduce, whose P factors are that small) waited
    peer_timeout for a stream lane and raised PeerTimeout / PeerClosed instead of RankMismatch."""
    for kind in ("ring", "ps", "ps-sharded"):
        for codec in ("dense", "dgt:p=0.3"):
            yield pytest.param(kind, codec, "dtype", "auto", 3, 1, 50, id=f"{kind}-{codec}-dtype-auto-w3-n50")


@pytest.mark.parametrize("odd", [0, 1])
async def test_a_model_server_rank_with_another_pull_codec_raises_rank_mismatch(odd):
    """The push codec agrees (dense) and one rank (the server, or the worker) was built with a Slim-DP pull: the
    pull's frames carry the pull codec's id, so the worker raises RankMismatch naming the codecs on the first pulled
    message. The server's step ends once its pull is sent (nothing comes back in a step), so it learns of it from the
    worker's abort and raises the same RankMismatch at its next step, at once. Before, the pull carried the push
    codec's id: the ranks raised RankMismatch too, but named it "different sizes or dtypes" (a pull that did not
    fit), not the codecs they disagree on."""
    async def fn(r, g):
        pull = "slimdp:alpha=0.3,eps=0.15,q=3" if r == odd else "dense"
        x = torch.ones(5000)
        ms = ModelServer(g, "dense", pull=pull, model=x, lr=0.1)
        steps = 0
        try:
            for _ in range(2):
                await ms.step(torch.full_like(x, 0.5), x.clone())
                steps += 1
        except RankMismatch as exc:
            return exc, steps
        return "returned", steps

    res = await _on_every_rank(2, "auto", fn, error_feedback=False)
    (server, server_steps), _ = res[0]
    (worker, worker_steps), _ = res[1]
    for r, (outcome, took) in enumerate(res):
        assert took < PEER_TIMEOUT, (r, took, outcome)
    assert isinstance(worker, RankMismatch) and worker_steps == 0, (worker, worker_steps)
    assert "different codecs (dense / slimdp)" in str(worker)
    assert isinstance(server, RankMismatch) and server_steps == 1, (server, server_steps)
    assert "different codecs (dense / slimdp)" in str(server)


@pytest.mark.parametrize("kind,codec,what,streams,world,odd,n",
                         [pytest.param(*c.values, 5000, id=c.id) for c in _mismatch_cases()]
                         + list(_small_mismatch_cases()))
async def test_ranks_that_disagree_raise_the_same_rank_mismatch_within_peer_timeout(kind, codec, what, streams,
                                                                                    world, odd, n):
    async def fn(r, g):
        me = r == odd
        other = "dense" if codec != "dense" else ("qsgd" if kind == "model-server" else "dgt:p=0.3")
        if codec.startswith("lowrank:"):
            other = "lowrank"
        mine = other if (what == "codec" and me) else codec
        dtype = torch.float64 if (what == "dtype" and me) else torch.float32
        x = torch.ones(n + (what == "numel" and me), dtype=dtype)
        if kind == "model-server":
            ms = ModelServer(g, mine, model=x, lr=0.1)
            await ms.step(torch.full_like(x, 0.5), x.clone())
            return "returned"
        coll = _build(kind, g, mine, op="mean" if (what == "op" and me) else "sum")
        await _call(kind, coll, x)
        return "returned"

    # Slim-DP's explorer blocks and the low-rank residual's are records the algorithm drops: both refuse the
    # transport's error feedback
    res = await _on_every_rank(world, streams, fn, error_feedback=not codec.startswith(("slimdp", "lowrank:")))
    reasons = set()
    for r, (outcome, took) in enumerate(res):
        assert isinstance(outcome, RankMismatch), (r, outcome)
        assert took < PEER_TIMEOUT, (r, took, outcome)
        reason = str(outcome).split("aborted: ")[-1]  # a rank told by another gets that rank's own reason
        assert any(w in reason for w in REASONS[what]), (r, reason)
        reasons.add(reason)
    assert len(reasons) == 1, reasons


# -- any layout the API accepts -------------------------------------------------------------------------------------


def _tensor(layout, r):
    base = torch.arange(20000, dtype=torch.float32) * (r + 1) / 7
    if layout == "strided":
        return base[::2]  # a non-contiguous 1-D view
    if layout == "offset":
        return base[3:5003]  # contiguous, with a storage offset
    if layout == "channels-last":
        return base[: 2 * 8 * 25 * 25].reshape(2, 8, 25, 25).contiguous(memory_format=torch.channels_last)
    if layout == "transposed":
        return base[: 100 * 60].reshape(100, 60).t()
    if layout == "0-d":
        return base[5].clone().reshape(())
    if layout == "empty":
        return base[:0]
    raise AssertionError(layout)


LAYOUTS = ["strided", "offset", "channels-last", "transposed", "0-d", "empty"]


def _layout_cases():
    for kind in COLLECTIVES:
        for codec in ("dense", "dgt:p=1.0"):  # p=1: every block important (reliable), so the sum is exact
            for layout in LAYOUTS:
                for inplace in ((False,) if kind == "gossip" else (False, True)):
                    yield pytest.param(kind, codec, layout, inplace,
                                       id=f"{kind}-{codec}-{layout}{'-inplace' if inplace else ''}")


@pytest.mark.parametrize("kind,codec,layout,inplace", list(_layout_cases()))
async def test_every_layout_is_reduced_correctly_on_every_collective_and_codec(kind, codec, layout, inplace):
    world = 2
    ref = sum(_tensor(layout, r) for r in range(world))
    if kind == "gossip":
        ref = ref / world  # the default mixing matrix of two ranks: the mean

    async def fn(r, g):
        x = _tensor(layout, r)
        before = x.stride()
        res = await _call(kind, _build(kind, g, codec), x, out=x if inplace else None)
        return x, before, res.tensor

    for r, (outcome, _) in enumerate(await _on_every_rank(world, "auto", fn)):
        assert not isinstance(outcome, BaseException), (r, outcome)
        x, before, got = outcome
        assert got.shape == ref.shape and got.dtype == ref.dtype, (r, got.shape, got.dtype)
        torch.testing.assert_close(got, ref)
        assert x.stride() == before  # the caller's tensor keeps its layout
        if inplace:
            torch.testing.assert_close(x, ref)  # the result is in the caller's tensor itself
            assert got.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_every_layout_is_reduced_correctly_by_the_low_rank_all_reduce(layout):
    """The low-rank all-reduce (no ``out``) of each layout, its tensor declared with its own shape (a matrix where it
    has >= 2 dimensions: sent as rank-1 factors), equals the codec's in-process reduction of contiguous copies, in
    the caller's shape and dtype, on every rank."""
    world = 2
    xs = [_tensor(layout, r).contiguous() for r in range(world)]
    codecs = [LowRankCodec() for _ in range(world)]
    states = [BucketState(x.numel(), x.dtype) for x in xs]
    for st in states:
        set_shapes(st, [tuple(xs[0].shape)])
    ref = reduce_in_process(codecs, states, xs)[0].view(xs[0].shape)

    async def fn(r, g):
        x = _tensor(layout, r)
        before = x.stride()
        res = await LowRankAllReduce(g, "lowrank", op="sum").allreduce(x, 0, [tuple(x.shape)])
        return x, before, res.tensor

    for r, (outcome, _) in enumerate(await _on_every_rank(world, "auto", fn)):
        assert not isinstance(outcome, BaseException), (r, outcome)
        x, before, got = outcome
        assert got.shape == ref.shape and got.dtype == ref.dtype, (r, got.shape, got.dtype)
        torch.testing.assert_close(got, ref)
        assert x.stride() == before


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("codec", ["dense", "qsgd"])
async def test_every_layout_is_served_correctly_by_the_model_server(codec, layout):
    """The model server's step (delta and local model of each layout; the model the same layout on every rank): the
    result is the server's model after one step, ``w - lr * sum(decoded deltas)``, in the shape of ``local``, the
    same on every rank; the caller's tensors keep their layout. Dense: exact; QSGD: within a quantisation level
    of each delta (its scale / 127 per element)."""
    world, lr = 2, 0.1
    w0 = _tensor(layout, 5)
    ref = w0 - lr * sum(_tensor(layout, r) for r in range(world))

    async def fn(r, g):
        delta, local = _tensor(layout, r), _tensor(layout, 5)
        before = (delta.stride(), local.stride())
        ms = ModelServer(g, codec, model=_tensor(layout, 5), lr=lr)
        res = await ms.step(delta, local)
        return (delta.stride(), local.stride()), before, res.tensor

    results = await _on_every_rank(world, "auto", fn)
    for r, (outcome, _) in enumerate(results):
        assert not isinstance(outcome, BaseException), (r, outcome)
        after, before, got = outcome
        assert after == before
        assert got.shape == ref.shape and got.dtype == ref.dtype, (r, got.shape, got.dtype)
        if codec == "dense":
            torch.testing.assert_close(got, ref)
        elif ref.numel():  # one level of each rank's delta at most: max|delta| / 127 per rank
            tol = lr * sum(float(_tensor(layout, r).abs().max()) for r in range(world)) / 127
            assert float((got - ref).abs().max()) <= tol * (1 + 1e-5) + 1e-6, (r, float((got - ref).abs().max()))
        torch.testing.assert_close(got, results[0][0][2])  # every rank holds the server's model


def _refused():
    dense = torch.ones(8)
    return [
        ("sparse", dense.to_sparse(), None, "dense \\(strided\\)"),
        ("list", [1.0, 2.0], None, "torch.Tensor"),
        ("out-size", dense, torch.ones(7), "out must be"),
        ("out-dtype", dense, torch.ones(8, dtype=torch.float64), "out must be"),
        ("out-list", dense, [0.0] * 8, "torch.Tensor"),
    ]


@pytest.mark.parametrize("kind", COLLECTIVES)
@pytest.mark.parametrize("codec", ["dense", "dgt:p=0.3"])
async def test_what_cannot_be_reduced_is_refused_with_input_rejected_before_any_traffic(kind, codec):
    g = Group(OfflineTransport(), 0, 2, 1)  # no endpoint: any traffic would fail with another error
    coll = _build(kind, g, codec)
    for _name, x, out, words in _refused():
        if kind == "gossip" and out is not None:
            continue  # gossip's mix has no out
        with pytest.raises(InputRejected, match=words):
            with trio.fail_after(5):
                await _call(kind, coll, x, out=out)


@pytest.mark.parametrize("codec", ["qsgd", "olandraj"])
def test_the_ring_refuses_a_codec_that_is_not_summable_when_it_is_made(codec):
    """QSGD and Oland-Raj gather, then reduce: the ring (which adds payloads on the way) refuses them at construction
    (CodecMismatch, a DgtError), so the agreement matrix runs them on the parameter servers and gossip only."""
    from dgt.errors import CodecMismatch

    with pytest.raises(CodecMismatch, match="not summable"):
        RingAllReduce(Group(OfflineTransport(), 0, 2, 1), codec)


def _refused_elsewhere(kind):
    """(name, what the call gets, words of the refusal) for the low-rank all-reduce (bucket) and the model server
    (delta and local model of a float32 model of 8 elements)."""
    dense = torch.ones(8)
    cases = [("sparse", dense.to_sparse(), "dense \\(strided\\)"), ("list", [1.0] * 8, "torch.Tensor"),
             ("int", torch.ones(8, dtype=torch.int32), "cannot reduce|like the model")]
    if kind == "model-server":
        cases += [("size", torch.ones(7), "float32 tensor of 8 elements like the model"),
                  ("dtype", torch.ones(8, dtype=torch.float64), "float32 tensor of 8 elements like the model")]
    else:
        cases += [("shapes", dense, "hold 6 elements, the bucket has 8")]
    return cases


@pytest.mark.parametrize("kind", ["lowrank", "model-server"])
async def test_what_the_low_rank_all_reduce_and_the_model_server_cannot_take_is_refused_before_any_traffic(kind):
    g = Group(OfflineTransport(), 0, 2, 1)  # no endpoint: any traffic would fail with another error
    for name, x, words in _refused_elsewhere(kind):
        with pytest.raises(InputRejected, match=words):
            with trio.fail_after(5):
                if kind == "lowrank":
                    await LowRankAllReduce(g, "lowrank").allreduce(x, 0, [(2, 3)] if name == "shapes" else None)
                else:
                    ms = ModelServer(g, "dense", model=torch.zeros(8), lr=0.1, server=1)
                    await ms.step(x, torch.zeros(8) if name != "dtype" else x)


@pytest.mark.parametrize("kind", ["lowrank", "model-server"])
@pytest.mark.parametrize("odd", [0, 1])
async def test_one_rank_refusing_fails_the_low_rank_all_reduce_and_the_model_server_on_every_rank(kind, odd):
    """As for the other collectives: the refusing rank raises InputRejected, the other RankMismatch naming it, at
    once (it is told, control REFUSED), not after peer_timeout. Model server: the odd one out is the server (0) or
    the worker (1)."""

    async def fn(r, g):
        x = torch.ones(5000, dtype=torch.int32) if r == odd else torch.ones(5000)
        if kind == "lowrank":
            await LowRankAllReduce(g, "lowrank").allreduce(x, 0, [(50, 100)])
        else:
            await ModelServer(g, "dense", model=torch.ones(5000), lr=0.1).step(x, torch.ones(5000))
        return "returned"

    for r, (outcome, took) in enumerate(await _on_every_rank(2, "auto", fn)):
        if r == odd:
            assert isinstance(outcome, InputRejected), (r, outcome)
        else:
            assert isinstance(outcome, RankMismatch), (r, outcome)
            assert f"rank {odd} refused its input" in str(outcome), (r, outcome)
        assert took < PEER_TIMEOUT, (r, took, outcome)


# -- a refusal at the receiver reaches the sender -------------------------------------------------------------------


@pytest.mark.parametrize("what", ["dtype", "size"])
@pytest.mark.parametrize("lossy", [False, True], ids=["lossless", "lossy"])
async def test_a_round_the_receiver_refuses_fails_the_senders_send_round(what, lossy):
    """The receiver's landing (``recv_round(out=...)``) is another dtype or size than the round: the receiver raises
    RankMismatch, and so does the sender's ``send_round`` (it returned as if the round had been taken)."""
    from dgt.errors import shape_mismatch
    from dgt.harness.endpoints import connected_pair
    from dgt.layout import BucketLayout

    cfg = TransportConfig(timeouts=Timeouts(peer=PEER_TIMEOUT), hops=Hops(mode="off"))
    x = torch.randn(4096)
    out = torch.empty(4096, dtype=torch.float64) if what == "dtype" else torch.empty(4095)
    lay = BucketLayout([x.numel()], DEFAULT_BLOCK)
    cls = torch.tensor([0, 1, 1, 1], dtype=torch.int8) if lossy else 0
    seen = {}
    with trio.fail_after(BOUND):
        async with connected_pair(0x45, cfg) as (a, b):

            async def send():
                try:
                    await a.send_round(1, 4, 7, x, lay, cls)
                    seen["send"] = "returned"
                except DgtError as exc:
                    seen["send"] = exc

            async with trio.open_nursery() as n:
                n.start_soon(send)
                with pytest.raises(RankMismatch) as info:
                    await b.recv_round(0, 4, 7, out=out, timeout=PEER_TIMEOUT)
    assert str(info.value) == shape_mismatch(7)
    assert isinstance(seen["send"], RankMismatch), seen
    assert str(seen["send"]) == str(info.value)  # the same reason on both ends
    assert "expects" in seen["send"].detail


@pytest.mark.parametrize("lossy", [False, True], ids=["lossless", "lossy"])
async def test_a_refusal_in_the_middle_of_a_multi_round_call_fails_both_ends_and_the_pair_stays_usable(lossy):
    """A refusal after traffic has started: a call of three rounds (three buckets, as a collective's parts or a DDP
    step's buckets), the first landing whole, the receiver's landing for the second of another size (refused when
    that round arrives). The receiver raises RankMismatch, the sender's second send_round the same one (it is told,
    control STALE, instead of returning as if the round had been taken), within the bound; nothing waits for the
    third round's timeout. The connection itself stays usable: a later round on another key lands bit-exact."""
    from dgt.errors import shape_mismatch
    from dgt.harness.endpoints import connected_pair
    from dgt.layout import BucketLayout

    cfg = TransportConfig(peer_timeout=PEER_TIMEOUT, stream_hops="off")
    xs = [torch.randn(4096, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    lay = BucketLayout([4096], DEFAULT_BLOCK)
    cls = torch.tensor([0, 1, 1, 1], dtype=torch.int8) if lossy else 0
    sent = {}
    t0 = time.monotonic()
    with trio.fail_after(BOUND):
        async with connected_pair(0x46, cfg) as (a, b):

            async def send():
                for i in range(3):
                    try:
                        await a.send_round(1, 10 + i, 7, xs[i], lay, cls)
                        sent[i] = "returned"
                    except DgtError as exc:
                        sent[i] = exc
                        return

            async with trio.open_nursery() as n:
                n.start_soon(send)
                first = await b.recv_round(0, 10, 7, out=torch.empty(4096), timeout=PEER_TIMEOUT)
                with pytest.raises(RankMismatch) as info:
                    await b.recv_round(0, 11, 7, out=torch.empty(4095), timeout=PEER_TIMEOUT)
            took = time.monotonic() - t0
            # the same pair afterwards: a round on a key of its own lands whole
            async with trio.open_nursery() as n:
                n.start_soon(a.send_round, 1, 20, 7, xs[3], lay, 0)
                later = await b.recv_round(0, 20, 7, out=torch.empty(4096), timeout=PEER_TIMEOUT)
    if not lossy:
        assert torch.equal(first.data, xs[0])  # the first round landed whole before the refusal
    else:
        assert torch.equal(first.data[:1024], xs[0][:1024])  # its reliable block at least
    assert str(info.value) == shape_mismatch(7)
    assert sent[0] == "returned"
    assert isinstance(sent[1], RankMismatch) and str(sent[1]) == str(info.value), sent
    assert 2 not in sent  # the call stopped at the refused round: its third round was never sent
    assert took < PEER_TIMEOUT, took
    assert torch.equal(later.data, xs[3])


async def test_a_call_whose_later_part_is_refused_fails_every_rank_with_dgt_errors():
    """A call of several parts (Gossip.exchange_parts, as DCD/ECD nodes drive it) whose second part has a class
    array of the wrong length. Before: an IndexError on the refusing rank (counting the part's bytes) half way
    through the call, its neighbour left waiting. Now every part is checked before the first one's frames leave:
    InputRejected on that rank, RankMismatch naming it on the neighbour, at once."""
    from dgt.codecs.base import Part

    async def fn(r, g):
        ok = Part(torch.ones(4096), 0, 1024)
        bad = Part(torch.ones(4096), torch.tensor([0, 1], dtype=torch.int8) if r == 1 else 0, 1024)
        await Gossip(g, "dense").exchange_parts([ok, bad])
        return "returned"

    res = await _on_every_rank(2, "auto", fn)
    assert isinstance(res[1][0], InputRejected) and "lane classes have shape (2,)" in str(res[1][0]), res[1]
    assert isinstance(res[0][0], RankMismatch) and "rank 1 refused its input" in str(res[0][0]), res[0]
    assert all(took < PEER_TIMEOUT for _, took in res), res


# -- one rank refuses its input, or every rank does ------------------------------------------------------------------


def _refused_input(codec, how, n=5000):
    """An input ``codec`` refuses on every collective (InputRejected before any traffic): a dtype it does not carry
    (the dgt codec: floating tensors only; dense: the wire's dtypes, so not complex), or a sparse tensor."""
    if how == "dtype":
        return torch.ones(n, dtype=torch.int32 if codec.startswith("dgt") else torch.complex64)
    return torch.ones(n).to_sparse()


def _refusal_cases():
    for streams, world in (("auto", 2), ("auto", 3), ("off", 3)):
        for kind in COLLECTIVES:
            if kind == "gossip" and streams == "off":
                continue  # gossip has no stream path
            for codec in ("dense", "dgt:p=0.3"):
                for how in ("dtype", "sparse"):
                    yield pytest.param(kind, codec, how, streams, world, 1,
                                       id=f"{kind}-{codec}-{how}-{streams}-w{world}")
    for codec in ("dense", "dgt:p=0.3"):  # the central server refuses: its workers only talk to it
        yield pytest.param("ps", codec, "dtype", "auto", 3, 0, id=f"ps-server-{codec}-dtype")


@pytest.mark.parametrize("kind,codec,how,streams,world,odd", list(_refusal_cases()))
async def test_one_rank_refusing_its_input_fails_every_rank_within_peer_timeout(kind, codec, how, streams, world, odd):
    """The refusing rank raises InputRejected; every other rank of the call raises RankMismatch naming that rank and
    its reason (it is told, control REFUSED, instead of waiting for a rank that never sends): none waits for
    peer_timeout, or for round_timeout on the round path."""

    async def fn(r, g):
        coll = _build(kind, g, codec)
        x = _refused_input(codec, how) if r == odd else torch.ones(5000)
        await _call(kind, coll, x)
        return "returned"

    res = await _on_every_rank(world, streams, fn)
    for r, (outcome, took) in enumerate(res):
        if r == odd:
            assert isinstance(outcome, InputRejected), (r, outcome)
        else:
            assert isinstance(outcome, RankMismatch), (r, outcome)
            assert f"rank {odd} refused its input" in str(outcome), (r, outcome)
            assert ("cannot reduce" if how == "dtype" else "dense (strided)") in str(outcome), (r, outcome)
        assert took < PEER_TIMEOUT, (r, took, outcome)  # (a rank left waiting would get PeerTimeout or worse)


@pytest.mark.parametrize(("kind", "streams"), [(k, s) for k in COLLECTIVES for s in ("auto", "off")
                                                if not (k == "gossip" and s == "off")])  # gossip has no stream path
@pytest.mark.parametrize("codec", ["dense", "dgt:p=1.0"])  # p=1: every block reliable, so the sum is exact
async def test_every_rank_refusing_the_same_input_leaves_the_group_usable(kind, codec, streams):
    """The common error: every rank passes the same bad input. Each raises InputRejected, and the peers' refusal
    notices of that call do not fail the next, correct call on the same group (twice, so a late notice of the first
    refusal would be seen)."""
    world = 3

    async def fn(r, g):
        coll = _build(kind, g, codec)
        seen = []
        for how in ("dtype", "sparse"):
            with pytest.raises(InputRejected):
                await _call(kind, coll, _refused_input(codec, how))
            if r == 0:
                await trio.sleep(0.2)  # the others' notices of this call arrive while rank 0 is between calls
            res = await _call(kind, coll, torch.full((5000,), float(r + 1)))
            seen.append(res.tensor)
        return seen

    res = await _on_every_rank(world, streams, fn)
    want = 2.0 if kind == "gossip" else 6.0  # gossip, 3 ranks: the mean of 1, 2, 3 (the default mixing matrix)
    for r, (outcome, _) in enumerate(res):
        assert not isinstance(outcome, BaseException), (r, outcome)
        assert len(outcome) == 2
        for got in outcome:
            torch.testing.assert_close(got, torch.full((5000,), want))


@pytest.mark.parametrize("kind", COLLECTIVES)
async def test_after_one_rank_refused_the_next_call_fails_on_every_rank_without_waiting(kind):
    """After a one-sided refusal the session is over (as after any mismatch): the next call, correct on every rank,
    raises RankMismatch at once on each, the refusing rank included (its peers' ABORT reached it), never a hang."""

    async def fn(r, g):
        coll = _build(kind, g, "dgt:p=0.3")
        with pytest.raises((InputRejected, RankMismatch)):
            await _call(kind, coll, _refused_input("dgt", "dtype") if r == 1 else torch.ones(5000))
        t0 = time.monotonic()
        try:
            await _call(kind, coll, torch.ones(5000))
        except DgtError as exc:
            return exc, time.monotonic() - t0
        return "returned", time.monotonic() - t0

    for r, (outcome, _) in enumerate(await _on_every_rank(3, "auto", fn)):
        assert not isinstance(outcome, BaseException), (r, outcome)
        exc, took = outcome
        assert isinstance(exc, RankMismatch), (r, exc)
        assert "rank 1 refused its input" in str(exc), (r, exc)
        assert took < PEER_TIMEOUT, (r, took, exc)
