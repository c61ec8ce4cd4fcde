"""The model-holding parameter server over the real transport (OS processes, loopback sockets): Slim-DP push and
pull reproduce the in-process simulation bit for bit, put exactly the codec's bytes on each lane, survive explorer
loss with consistent accounting, and train digits as well as dense push/pull."""

from __future__ import annotations

import math

import pytest
import torch

from dgt.codecs.base import BucketState
from dgt.codecs.slimdp import HEADER_BYTES, SlimDPCodec
from dgt.collectives.launch import run_ranks
from dgt.collectives.model_server import ModelServer
from dgt.harness.simulate import MLP, Shards, digits, train_ps
from dgt.layout import BucketLayout
from dgt.wire import HEADER_SIZE

SLIM = "slimdp:alpha=0.3,eps=0.15,q=3,seed=0"


@pytest.fixture
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run with one thread each: the simulation must do the same arithmetic
    yield
    torch.set_num_threads(old)


def _train(rank, world, specs, rounds, lr, seed, cfg_kwargs=None, device="cpu", batch=32):
    """One rank of synchronous PS training on digits, the same loop as ``simulate.train_ps``, once per push spec
    in ``specs`` (each from the same initial model, its own ModelServer on its own bucket id, one group)."""
    import trio

    from dgt.collectives import Group
    from dgt.harness.simulate import MLP, Shards, digits
    from dgt.transport import TransportConfig

    model = MLP()
    data = digits()

    async def one(g, bucket_id: int, spec: str | tuple[str, dict]) -> dict:
        spec, opts = (spec, {}) if isinstance(spec, str) else spec
        shards = Shards(data, world, seed)
        w0 = model.init(seed).to(device)
        ms = ModelServer(g, spec, model=w0, lr=lr, segments=model.segments, bucket_id=bucket_id, **opts)
        local = w0.clone()
        stats = []
        for _ in range(rounds):
            if ms.is_server and not ms.server_trains:
                stats.append((await ms.step(None, None)).stats.to_dict())
                continue
            xb, yb = shards.batch(rank, batch)
            grad = model.loss_grad(local, xb.to(device), yb.to(device))
            local -= lr * grad
            res = await ms.step(grad, local)
            assert res.tensor.device == local.device
            local = res.tensor
            stats.append(res.stats.to_dict())
        out = {"local": local.cpu(), "stats": stats}
        if ms.is_server:
            out["w"] = ms.w.cpu()
            out["eval"] = model.evaluate(ms.w.cpu(), data)
        return out

    async def main():
        async with Group.open(rank, world, config=TransportConfig(**(cfg_kwargs or {})), timeout=30) as g:
            return [await one(g, i, spec) for i, spec in enumerate(specs)]

    return trio.run(main)


def _run(world, spec, *args, **kw):
    """{rank: output} of one training run."""
    return {r: v[0] for r, v in run_ranks(_train, world, [spec], *args, **kw).items()}


# ---------------------------------------------------------------------------------------------------------------
# no processes: geometry and configuration
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [SLIM, "slimdp:alpha=0.2,eps=0.1,shared_seed=true", "slimdp:alpha=0.3,eps=0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_wire_parts_describe_every_message_from_its_header(spec, dtype):
    from dgt.codecs import make_codec

    c = make_codec(spec)
    n = 4810
    st = BucketState(n, dtype)
    for step in range(4):  # refresh and cached rounds
        x = torch.randn(n, generator=torch.Generator().manual_seed(step)).to(dtype)
        parts = c.encode(x, st)
        geo = c.wire_parts(parts[0].data, x)
        assert [p.name for p in geo] == [p.name for p in parts]
        for p, q in zip(parts, geo):
            assert (q.data.numel(), q.data.dtype, q.block_elems) == (p.data.numel(), p.data.dtype, p.block_elems)
            assert q.lane_class == p.lane_class


def test_whole_blocks_maps_transport_loss_to_codec_blocks():
    t = BucketLayout([5000], 1024)  # 5 transport blocks
    c = BucketLayout([5000], 6 * 128)  # 7 codec blocks
    m = torch.tensor([True, False, True, True, True])
    got = c.whole_blocks(m, t)
    elem_ok = t.expand(m)
    want = torch.stack([elem_ok[s : s + n].all() for s, n in zip(c.block_start.tolist(), c.block_len.tolist())])
    assert torch.equal(got, want) and not bool(got.all())
    assert bool(c.whole_blocks(torch.ones(5, dtype=torch.bool), t).all())
    assert torch.equal(BucketLayout([5000], 1024).whole_blocks(m, t), m)


def test_slimdp_refuses_transport_error_feedback():
    from dgt.collectives.group import Group
    from dgt.transport import TransportConfig

    class FakeEndpoint:
        def __init__(self, ef: bool) -> None:
            self.cfg = TransportConfig(error_feedback=ef)

    w = torch.zeros(100)
    with pytest.raises(ValueError, match="error_feedback=False"):
        ModelServer(Group(FakeEndpoint(True), 0, 2, 1), SLIM, model=w, lr=0.1)
    ms = ModelServer(Group(FakeEndpoint(False), 0, 2, 1), SLIM, model=w, lr=0.1)
    assert (ms.pull_codec.mode, ms.pull_codec.rank, ms.push_tx.rank) == ("pull", 2, 0)
    dense = ModelServer(Group(FakeEndpoint(True), 1, 2, 1), "dense", model=w, lr=0.1)  # dense: nothing droppable
    assert dense.pull_codec.name == "dense" and dense.w is None
    with pytest.raises(ValueError, match="merge"):
        ModelServer(Group(FakeEndpoint(False), 0, 2, 1), "dense", "qsgd", model=w, lr=0.1)


# ---------------------------------------------------------------------------------------------------------------
# over the transport
# ---------------------------------------------------------------------------------------------------------------

NOEF = {"error_feedback": False}


def test_lossless_slimdp_equals_the_simulation_bit_for_bit_and_bytes_are_exact(one_thread):
    world, rounds, lr, seed = 3, 7, 0.1, 0
    # explorer records travel as datagrams closed by a deadline: a generous one, so that a CPU-starved receiver (a
    # loaded CI machine) still gets every one of them; nothing is lost here, so every round closes complete at once
    out = _run(world, SLIM, rounds, lr, seed, {**NOEF, "deadline": "fixed:10"}, timeout=120)
    sim = train_ps(SLIM, SLIM, k=world, rounds=rounds, lr=lr, batch=32, seed=seed)
    lost = [(t, out[0]["stats"][t]["dropped"]) for t in range(rounds) if out[0]["stats"][t]["dropped"]]
    assert not lost, f"blocks lost at the server (round, blocks): {lost}"
    assert torch.equal(out[0]["w"], sim["final_params"]), "the server's model differs from the simulation's"
    for r in range(world):
        assert torch.equal(out[r]["local"], sim["local_models"][r]), f"rank {r}'s replica differs"

    # bytes: every push is header + core values (+ the core bitmap on refresh rounds) on lane 0, explorer records
    # on lane 1: (alpha + eps) N values' worth plus the 24-byte header, exactly what the codec accounts
    codec = SlimDPCodec(alpha=0.3, eps=0.15, q=3)
    n = sim["numel"]
    k_core, k_exp = codec.set_sizes(n)
    assert (k_core, k_exp) == (round(0.15 * n), round(0.15 * n))
    steady = codec.steady_bytes(n)
    assert steady == HEADER_BYTES + 4 * (k_core + 2 * k_exp)
    assert abs(steady - HEADER_BYTES - 4 * 0.45 * n) <= 4 * 2  # (alpha + eps) N values, up to the rounding of k
    for t in range(rounds):
        refresh = t % 3 == 0
        lane0 = HEADER_BYTES + 4 * k_core + (math.ceil(n / 8) if refresh else 0)
        lane1 = 8 * k_exp
        assert lane0 + lane1 == (codec.refresh_bytes(n) if refresh else steady)
        for r in (1, 2):  # workers: what they sent is their push; what they received is the pull
            st = out[r]["stats"][t]
            assert st["bytes_sent"] == {0: lane0, 1: lane1}
            got = {lane: st["bytes_received"][lane] - HEADER_SIZE * st["frames_received"][lane] for lane in (0, 1)}
            assert got == {0: lane0, 1: lane1}  # the pull: the same codec on the model, same sizes
        server = out[0]["stats"][t]
        assert server["bytes_sent"] == {0: 2 * lane0, 1: 2 * lane1}  # one pull to each remote worker
        payload = {lane: server["bytes_received"][lane] - HEADER_SIZE * server["frames_received"][lane]
                   for lane in (0, 1)}
        assert payload == {0: 2 * lane0, 1: 2 * lane1}  # two remote pushes, nothing else
        assert server["dropped"] == 0 and sum(server["lost_elems"].values()) == 0
    # against dense push/pull: N values per direction
    assert sim["push_bytes_per_round_per_worker"] < 0.5 * 4 * n


def test_dense_push_and_pull_equal_the_simulation(one_thread):
    world, rounds, lr, seed = 3, 5, 0.1, 1
    both = run_ranks(_train, world, ["dense", ("dense", {"server_trains": False})], rounds, lr, seed, timeout=120)
    out = {r: v[0] for r, v in both.items()}
    sim = train_ps(None, None, k=world, rounds=rounds, lr=lr, batch=32, seed=seed)
    # the simulation sums dense gradients with torch.stack(...).sum(0), the collective with the codec's running sum
    # in rank order; a reduction over the outer dimension adds row by row, so the additions are the same ones
    assert torch.equal(out[0]["w"], sim["final_params"])
    for r in range(world):
        assert torch.equal(out[r]["local"], sim["local_models"][r])
        assert torch.equal(out[r]["local"], out[0]["w"])  # a dense pull replaces the replica
    n = sim["numel"]
    for r in (1, 2):
        assert all(st["bytes_sent"] == {0: 4 * n} for st in out[r]["stats"])
    # a server that only serves: w <- w - lr * (g_1 + g_2), the workers' gradients at the pulled model
    model, data = MLP(), digits()
    shards = Shards(data, world, seed)
    w = model.init(seed)
    for _ in range(rounds):
        grads = [model.loss_grad(w, *shards.batch(r, 32)) for r in (1, 2)]
        agg = grads[0].clone()
        agg += grads[1]
        w -= lr * agg
    serving = {r: v[1] for r, v in both.items()}
    assert torch.equal(serving[0]["w"], w)
    assert all(torch.equal(serving[r]["local"], w) for r in (1, 2))
    assert all(st["bytes_sent"] == {0: 2 * 4 * n} for st in serving[0]["stats"])  # two dense pulls


@pytest.mark.slow  # default suite time (CI 10:20); the slow set runs it in CI
def test_explorer_loss_keeps_training_and_the_accounting_adds_up(one_thread):
    world, rounds, lr, seed = 3, 60, 0.1, 0
    cfg = {"error_feedback": False, "drop_fraction": 0.25, "drop_seed": 7}
    out = _run(world, SLIM, rounds, lr, seed, cfg, timeout=150)
    clean = train_ps(SLIM, SLIM, k=world, rounds=rounds, lr=lr, batch=32, seed=seed)
    init = MLP().evaluate(MLP().init(seed), digits())
    lossy = out[0]["eval"]
    assert lossy["train_loss"] < 0.5 * init["train_loss"]  # it trains
    assert lossy["accuracy"] > clean["accuracy"] - 5.0
    lost_push = lost_pull = dropped = 0
    for t in range(rounds):
        server = out[0]["stats"][t]
        workers = [out[r]["stats"][t] for r in (1, 2)]
        # the reliable lane loses nothing: header, core and core keys always arrive; the blocks the transport
        # reports dropped are exactly the explorer blocks the codec was told were lost (same 1024-byte geometry)
        for st in (server, *workers):
            assert {k for k, v in st["lost_elems"].items() if v} <= {"explorer"}
            assert st["dropped"] == st["lost_blocks"].get("explorer", 0)
        # pushes: what the workers put on lane 1 = what reached the server + what it counted lost
        sent1 = sum(st["bytes_sent"][1] for st in workers)
        got1 = server["bytes_received"].get(1, 0) - HEADER_SIZE * server["frames_received"].get(1, 0)
        assert sent1 == got1 + server["lost_elems"].get("explorer", 0)
        # pulls: the same per worker
        for st in workers:
            got1 = st["bytes_received"].get(1, 0) - HEADER_SIZE * st["frames_received"].get(1, 0)
            assert server["bytes_sent"][1] // 2 == got1 + st["lost_elems"].get("explorer", 0)
            lost_pull += st["lost_elems"].get("explorer", 0)
        lost_push += server["lost_elems"].get("explorer", 0)
        dropped += server["dropped"] + sum(st["dropped"] for st in workers)
    print(f"\n[model server loss] accuracy lossy={lossy['accuracy']:.2f} clean={clean['accuracy']:.2f} "
          f"train loss lossy={lossy['train_loss']:.3f} clean={clean['train_loss']:.3f} init={init['train_loss']:.3f} "
          f"explorer bytes lost push={lost_push} pull={lost_pull} transport blocks dropped={dropped}")
    assert lost_push > 0 and lost_pull > 0  # 25% of the datagrams went missing in each direction
    assert dropped > 0
    assert lost_push + lost_pull <= dropped * 1024


@pytest.mark.slow
def test_slimdp_reaches_dense_accuracy_on_digits_over_the_transport(one_thread):
    """3 ranks, 600 rounds, lr 0.2 (chosen with the simulation, which this collective reproduces exactly when nothing
    is lost: dense - Slim-DP = 0.37, 0.37, 0.93, 0.19 points on seeds 0..3). Both runs share one set of processes."""
    world, rounds, lr, seed = 3, 600, 0.2, 0
    spec = "slimdp:alpha=0.3,eps=0.15,q=20,seed=0"
    out = run_ranks(_train, world, ["dense", spec], rounds, lr, seed, NOEF, timeout=240)
    dense, slim = out[0][0], out[0][1]
    acc_dense, acc_slim = dense["eval"]["accuracy"], slim["eval"]["accuracy"]
    push_dense = sum(sum(st["bytes_sent"].values()) for st in out[1][0]["stats"]) / rounds
    push_slim = sum(sum(st["bytes_sent"].values()) for st in out[1][1]["stats"]) / rounds
    pull_slim = sum(sum(st["bytes_sent"].values()) for st in slim["stats"]) / rounds / (world - 1)
    secs = {name: sum(sum(st["phases"].values()) for st in run["stats"])
            for name, run in (("dense", out[1][0]), ("slimdp", out[1][1]))}
    print(f"\n[model server digits] dense={acc_dense:.2f} slimdp={acc_slim:.2f} push bytes/round/worker "
          f"dense={push_dense:.0f} slimdp={push_slim:.1f} (pull {pull_slim:.1f}) ratio={push_dense / push_slim:.3f} "
          f"worker comm s dense={secs['dense']:.1f} slimdp={secs['slimdp']:.1f}")
    assert acc_slim >= acc_dense - 1.0
    assert push_dense / push_slim > 2.1
    for r in range(world):  # a dense pull makes every replica the server's model
        assert torch.equal(out[r][0]["local"], dense["w"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_slimdp_model_server_on_cuda():
    world, rounds = 2, 4
    out = run_ranks(_train, world, [SLIM, "dense"], rounds, 0.1, 0, NOEF, "cuda", timeout=180)
    cpu = _run(world, "dense", rounds, 0.1, 0, NOEF, "cpu", timeout=180)
    n = out[0][0]["w"].numel()
    codec = SlimDPCodec(alpha=0.3, eps=0.15, q=3)
    for t in range(rounds):
        want = codec.refresh_bytes(n) if t % 3 == 0 else codec.steady_bytes(n)
        assert sum(out[1][0]["stats"][t]["bytes_sent"].values()) == want
    assert torch.isfinite(out[0][0]["w"]).all()
    torch.testing.assert_close(out[0][1]["w"], cpu[0]["w"], rtol=1e-4, atol=1e-5)


def test_slimdp_communication_frequency_matches_the_simulation(one_thread):
    """Slim-DP's p (``every``): 7 local steps with p=3 push the summed deltas of steps 1-3 and 4-6 and nothing
    after step 7; over the transport the models equal the simulation's bit for bit, and only every p-th step sends."""
    world, rounds, lr, seed, p = 3, 7, 0.1, 0, 3
    both = _run(world, (SLIM, {"every": p}), rounds, lr, seed, {**NOEF, "deadline": "fixed:10"}, timeout=120)
    sim = train_ps(SLIM, SLIM, k=world, rounds=rounds, lr=lr, batch=32, seed=seed, every=p)
    once = train_ps(SLIM, SLIM, k=world, rounds=rounds, lr=lr, batch=32, seed=seed)
    assert not torch.equal(sim["final_params"], once["final_params"])  # p changes the training
    assert torch.equal(both[0]["w"], sim["final_params"])
    for r in range(world):
        assert torch.equal(both[r]["local"], sim["local_models"][r])
    for t in range(rounds):
        sent = both[1]["stats"][t]["bytes_sent"]
        assert (sum(sent.values()) > 0) == ((t + 1) % p == 0), (t, sent)
    assert sim["push_bytes_per_round_per_worker"] * rounds == pytest.approx(
        once["push_bytes_per_round_per_worker"] * (rounds // p), rel=0.2)  # ~1/p of the bytes per mini-batch


def test_communication_frequency_is_checked():
    with pytest.raises(ValueError, match="every"):
        train_ps(SLIM, SLIM, k=2, rounds=2, every=0)
