"""The PyTorch drop-in: DDP communication hook and ``backend="dgt"``, across OS processes on loopback.

Process start (importing torch) dominates on small machines, so the multi-process checks share one spawn: the
default group is backend="dgt" and a Gloo subgroup of the same processes carries the Gloo reference; that run covers
the backend's collectives, DDP on the backend, the lossless hook (ring and PS) vs Gloo, the lossy hook, a checkpoint
round trip and an explicitly lossy dgt group. The torchrun-launched example and a dying peer run separately.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dgt.collectives.launch import run_ranks

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5
LOSSY_STEPS = 30


# -- a tiny deterministic problem -------------------------------------------------------------------------------
def _model(hidden: int = 256) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A teacher-labelled classification task; each rank its own 512 samples."""
    teacher = torch.randn(32, 4, generator=torch.Generator().manual_seed(99))
    x = torch.randn(512, 32, generator=torch.Generator().manual_seed(1000 + rank))
    return x, (x @ teacher).argmax(1)


def _train(ddp, rank: int, steps: int, state=None, lr: float = 0.1, device: torch.device | None = None
           ) -> list[float]:
    x, y = _data(rank)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        idx = torch.randint(len(x), (32,), generator=gen)
        xb, yb = (x[idx], y[idx]) if device is None else (x[idx].to(device), y[idx].to(device))
        loss = torch.nn.functional.cross_entropy(ddp(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if state is not None:
            state.observe_loss(loss)
        losses.append(loss.item())
    return losses


def _params(ddp) -> list[torch.Tensor]:
    return [p.detach().clone() for p in ddp.module.parameters()]


# -- no network ---------------------------------------------------------------------------------------------------
def test_default_state_drops_without_a_loss_feed_and_follows_one_when_fed():
    from dgt.shim import DGTState

    st = DGTState()  # the README line: nothing ever calls observe_loss
    assert st.codec.name == "dgt"
    assert st.codec.schedule.p() == pytest.approx(0.1)
    g = torch.randn(64 * 1024)
    parts = st.codec.encode(g, st.codec.state_for(0, g, None))
    cls = parts[0].lane_class
    assert 0 < int((cls == 0).sum()) < len(cls)  # some blocks important, the rest droppable
    st.observe_loss(2.0)
    st.observe_loss(1.0)
    assert st.codec.schedule.p() == pytest.approx(0.5)  # observe_loss still drives p = p0 * loss_t / loss_0


def test_state_pickles_with_codec_state_and_without_the_worker():
    from dgt.shim import DGTState

    st = DGTState(codec="dgt:p0=0.5", collective="ps", warmup_iters=3, transport={"drop_fraction": 0.1})
    g = torch.randn(5000)
    bs = st.codec.state_for(7, g, [4000, 1000])
    st.codec.encode(g, bs)
    st.observe_loss(torch.tensor(2.0))
    st.observe_loss(1.0)
    st.note_bucket(0, 5000, torch.float32, [4000, 1000])
    st.iter = 4
    back = pickle.loads(pickle.dumps(st))
    assert back.iter == 4 and back.warmup_iters == 3 and back.collective == "ps" and back.past_warmup
    assert back.buckets == st.buckets and back.process_group is None and back._worker is None
    assert back.codec.schedule.p() == pytest.approx(0.25)  # p0 * loss_t / loss_0 survives the round trip
    est0, est1 = bs.values["estimator"], back.codec.state_dict()[7].values["estimator"]
    assert torch.equal(est0.scores, est1.scores)
    # a bucket whose tensors change counts as rebuilt, once per iteration
    assert back.note_bucket(0, 5000, torch.float32, [2500, 2500]) is True
    assert back.note_bucket(1, 10, torch.float32, [10]) is False  # new bucket, nothing to reset
    assert back.bucket_resets == 1
    with pytest.raises(ValueError, match="collective"):
        DGTState(collective="tree")


def test_worker_runs_jobs_in_order_and_fails_later_jobs_after_an_error():
    import trio

    from dgt.collectives.worker import TrioWorker, WorkerClosed

    async def connect(nursery):
        assert nursery is not None  # the group's endpoint runs in the worker thread's nursery
        return "group"

    w = TrioWorker(connect)
    order = []

    def job(i, delay):
        async def run(group):
            await trio.sleep(delay)
            order.append(i)
            return (group, i)
        return run

    futs = [w.submit(job(i, 0.02 * (3 - i))) for i in range(4)]
    assert [f.wait() for f in futs] == [("group", i) for i in range(4)]
    assert order == [0, 1, 2, 3]

    async def boom(group):
        raise ValueError("collective failed")

    bad = w.submit(boom)
    later = w.submit(job(9, 0))
    for f in (bad, later):
        with pytest.raises(Exception, match="collective failed"):
            f.wait()
    w.close()
    assert not w.running
    with pytest.raises(WorkerClosed):
        w.submit(job(0, 0)).wait()

    async def no_group(nursery):
        raise ConnectionRefusedError("rendezvous failed")

    w2 = TrioWorker(no_group)
    with pytest.raises(Exception, match="rendezvous failed"):
        w2.submit(job(0, 0)).wait()
    w2.close()


def test_local_host_follows_the_route_to_the_store(monkeypatch):
    from dgt.shim.net import local_host

    monkeypatch.delenv("DGT_HOST", raising=False)
    assert local_host("localhost") == "127.0.0.1"
    monkeypatch.setenv("DGT_HOST", "10.1.2.3")
    assert local_host() == "10.1.2.3"


# -- hook and backend, one set of processes ------------------------------------------------------------------------
def _ranks(rank: int, world: int) -> dict:
    """The default group is backend="dgt"; a Gloo subgroup of the same processes carries the Gloo reference and the
    hook runs (so the hook is also exercised on an explicit, non-default process group)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dgt.shim

    out: dict = {}
    dist.init_process_group("dgt", rank=rank, world_size=world)
    pg = dist.distributed_c10d._get_default_group()
    gloo = dist.new_group(backend="gloo")
    out["backend"] = _backend_checks(rank, world, pg)

    # 1. reference: DDP on Gloo; small buckets, so DDP rebuilds them after iteration 1
    ref = DDP(_model(), bucket_cap_mb=0.01, process_group=gloo)
    _train(ref, rank, STEPS)
    out["gloo"] = _params(ref)
    # 2. DDP on the dgt backend, no hook: the reducer's all-reduce rides DGT (dense, lossless)
    ddp = DDP(_model(), bucket_cap_mb=0.01)
    out["backend_losses"] = _train(ddp, rank, STEPS)
    out["backend_ddp"] = _params(ddp)
    out["backend_stats"] = dict(pg.stats)
    # 3. the lossless hook (dense codec), ring and parameter server, on the Gloo group
    for coll in ("ring", "ps"):
        ddp = DDP(_model(), bucket_cap_mb=0.01, process_group=gloo)
        st = dgt.shim.DGTState(gloo, codec="dense", collective=coll, warmup_iters=0)
        ddp.register_comm_hook(st, dgt.shim.hook)
        _train(ddp, rank, STEPS)
        out[f"dense_{coll}"] = _params(ddp)
        out[f"dense_{coll}_state"] = (st.iter, st.bucket_resets, dict(st.totals))
        st.close()
    # 4. the lossy hook: DGT codec with p = p0 * loss_t / loss_0, 20% of datagrams discarded by the receivers
    ddp = DDP(_model(), bucket_cap_mb=0.01, process_group=gloo)
    # (the CPU gate off: on a busy host it would keep every unimportant block back, none for the loss to drop)
    st = dgt.shim.DGTState(gloo, codec="dgt:p0=0.5", warmup_iters=2,
                           transport={"drop_fraction": 0.2, "drop_seed": rank, "cpu_gate": 0.0})
    ddp.register_comm_hook(st, dgt.shim.hook)
    t0 = time.perf_counter()
    out["lossy_losses"] = _train(ddp, rank, LOSSY_STEPS, st)
    out["lossy_s_per_step"] = (time.perf_counter() - t0) / LOSSY_STEPS
    out["lossy_totals"] = dict(st.totals)
    out["lossy_p"] = st.codec.schedule.p()
    out["lossy_params"] = _params(ddp)
    # 5. checkpoint: pickle the state mid-training, close it, resume from the copy on DDP over the dgt backend
    #    (the default group, which unpickling binds to); a fresh worker reconnects
    blob = pickle.dumps(st)
    st.close()
    restored = pickle.loads(blob)
    ddp2 = DDP(_model(), bucket_cap_mb=0.01)
    ddp2.module.load_state_dict(ddp.module.state_dict())
    ddp2.register_comm_hook(restored, dgt.shim.hook)
    iter_before = restored.iter
    out["resumed_losses"] = _train(ddp2, rank, 3, restored)
    out["resumed"] = (iter_before, restored.iter, restored.totals["codec_buckets"], type(restored.process_group))
    out["resumed_params"] = _params(ddp2)
    restored.close()
    # 6. an explicitly lossy dgt group (pg_options): big all-reduces may lose blocks, small ones stay exact
    lossy_pg = dist.new_group(backend="dgt", pg_options=dgt.shim.DGTBackendOptions(
        codec="dgt:p=0.25", lossy_min_numel=1000, transport={"drop_fraction": 0.3, "drop_seed": 7 + rank}))
    big = torch.randn(20 * 1024, generator=torch.Generator().manual_seed(rank))
    small = torch.full((10,), float(rank + 1))
    dist.all_reduce(big, group=lossy_pg)
    dist.all_reduce(small, group=lossy_pg)
    out["lossy_pg"] = (big, small, dict(lossy_pg.stats))
    dist.destroy_process_group()
    return out


def _backend_checks(rank: int, world: int, pg) -> dict:
    import torch.distributed as dist

    out: dict = {"type": type(pg).__name__, "backend": dist.get_backend()}
    t = torch.arange(5000, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    out["sum"] = t
    a = torch.full((3,), float(rank + 1))
    dist.all_reduce(a, op=dist.ReduceOp.AVG)
    out["avg"] = a
    m = torch.tensor([rank, 10 - rank])
    dist.all_reduce(m, op=dist.ReduceOp.MAX)  # integer MAX: over Gloo
    out["max"] = m
    b = torch.full((4,), float(rank))
    dist.broadcast(b, src=1)
    out["bcast"] = b
    gathered = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank)))
    out["gather"] = gathered
    work = dist.all_reduce(torch.ones(10), async_op=True)
    work.wait()
    p2p = torch.full((3,), float(rank + 5))
    if rank == 0:
        dist.send(p2p, dst=1)
    elif rank == 1:
        dist.recv(p2p, src=0)
    out["p2p"] = p2p
    rs = torch.zeros(2)
    try:
        dist.reduce_scatter(rs, [torch.full((2,), float(rank + 1) * (j + 1)) for j in range(world)])
    except RuntimeError as exc:  # forwarded to Gloo, which has none on older torch (2.4: CI's oldest-versions run)
        if "ProcessGroupGloo does not support reduce_scatter" not in str(exc):
            raise
        rs = None
    out["reduce_scatter"] = rs
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_ranks, 2, timeout=300)


def _max_diff(xs, ys) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(xs, ys))


def test_hook_lossless_matches_gloo(runs):
    for r in (0, 1):
        for coll in ("ring", "ps"):
            got = runs[r][f"dense_{coll}"]
            diff = _max_diff(got, runs[r]["gloo"])
            print(f"rank {r} hook {coll} dense: max |param - gloo| after {STEPS} steps = {diff:.3g}")
            for a, b in zip(got, runs[r]["gloo"]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            iters, resets, totals = runs[r][f"dense_{coll}_state"]
            assert iters == STEPS and totals["dropped"] == 0 and totals["buckets"] >= STEPS
            assert resets >= 1, "DDP rebuilds its buckets after iteration 1 and the state must notice"


def test_hook_lossy_trains_drops_and_stays_consistent(runs):
    r0, r1 = runs[0], runs[1]
    for r in (r0, r1):
        losses = r["lossy_losses"]
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        print(f"lossy hook: loss {first:.3f} -> {last:.3f}, p={r['lossy_p']:.3f}, totals={r['lossy_totals']}, "
              f"{r['lossy_s_per_step'] * 1e3:.1f} ms/step")
        assert last < 0.7 * first
        assert r["lossy_totals"]["codec_buckets"] > 0
        assert r["lossy_p"] < 0.5, "the loss schedule lowered p as the loss fell"
    assert r0["lossy_totals"]["dropped"] + r1["lossy_totals"]["dropped"] > 0, "20% datagram loss dropped blocks"
    # the all-gather phase is reliable, so replicas stay identical even when blocks drop
    for a, b in zip(r0["lossy_params"], r1["lossy_params"]):
        assert torch.equal(a, b)


def test_hook_state_checkpoint_resumes(runs):
    import dgt.shim

    for r in (0, 1):
        before, after, lossy, pg_type = runs[r]["resumed"]
        assert before == LOSSY_STEPS and after == before + 3 and lossy > 0
        assert pg_type is dgt.shim.DGTProcessGroup  # unpickled onto the default group, like PowerSGDState
        assert all(v == v for v in runs[r]["resumed_losses"])
    for a, b in zip(runs[0]["resumed_params"], runs[1]["resumed_params"]):
        assert torch.equal(a, b)


def test_backend_collectives(runs):
    for r in (0, 1):
        o = runs[r]["backend"]
        assert o["type"] == "DGTProcessGroup" and o["backend"] == "dgt"
        torch.testing.assert_close(o["sum"], torch.arange(5000, dtype=torch.float32) * 3)
        torch.testing.assert_close(o["avg"], torch.full((3,), 1.5))
        assert o["max"].tolist() == [1, 10]
        assert o["bcast"].tolist() == [1.0] * 4
        assert [g.tolist() for g in o["gather"]] == [[0.0, 0.0], [1.0, 1.0]]
        assert o["p2p"].tolist() == [5.0] * 3
        if o["reduce_scatter"] is None:  # only where torch's own Gloo lacks it, never on the README's torch
            assert tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13)
        else:
            assert o["reduce_scatter"].tolist() == [3.0 * (r + 1)] * 2  # sum over ranks of (rank + 1) * (r + 1)


def test_backend_forwards_inherited_collectives_to_gloo_from_python():
    """torch's C++ trampoline calls an inherited collective with the GIL held, which can deadlock against Gloo's
    worker freeing a finished work (it takes the GIL under Gloo's queue mutex); every collective it would route that
    way is overridden in Python and calls the Gloo backend's binding, which releases the GIL."""
    import torch.distributed as dist

    from dgt.shim.backend import _TO_GLOO, DGTProcessGroup

    for name in _TO_GLOO:
        assert name in DGTProcessGroup.__dict__ and getattr(dist.ProcessGroupGloo, name), name


def test_backend_lossy_only_when_asked(runs):
    exact = torch.randn(20 * 1024, generator=torch.Generator().manual_seed(0))
    exact += torch.randn(20 * 1024, generator=torch.Generator().manual_seed(1))
    (b0, s0, st0), (b1, s1, st1) = runs[0]["lossy_pg"], runs[1]["lossy_pg"]
    assert torch.equal(b0, b1), "the reliable all-gather leaves every rank the same result"
    assert s0.tolist() == [3.0] * 10 and s1.tolist() == [3.0] * 10, "small tensors stay lossless"
    assert st0["lossy"] == 1 and st0["dgt"] == 2
    wrong = (b0 - exact).abs().view(-1, 1024).amax(1) > 1e-5
    print(f"lossy dgt group: {int(wrong.sum())}/20 blocks differ from the exact sum; dropped {st0['dropped']}+"
          f"{st1['dropped']}")
    assert st0["dropped"] + st1["dropped"] > 0 and 0 < int(wrong.sum()) < 20


def test_backend_ddp_trains_like_gloo(runs):
    for r in (0, 1):
        o = runs[r]
        print(f"rank {r}: DDP on backend=dgt vs Gloo: max |param diff| = {_max_diff(o['backend_ddp'], o['gloo']):.3g};"
              f" stats {o['backend_stats']}")
        for a, b in zip(o["backend_ddp"], o["gloo"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert o["backend_losses"][-1] < o["backend_losses"][0]
        st = o["backend_stats"]
        assert st["dgt"] >= 3 + STEPS and st["gloo"] >= 1 and st["lossy"] == 0  # default group: lossless


def _dying_rank(rank: int, world: int) -> str:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dgt.shim

    dist.init_process_group("gloo", rank=rank, world_size=world)
    ddp = DDP(_model())
    st = dgt.shim.DGTState(codec="dense", warmup_iters=0, transport={"peer_timeout": 3.0})
    ddp.register_comm_hook(st, dgt.shim.hook)
    _train(ddp, rank, 2)
    if rank == 1:
        os._exit(17)  # dies between steps without closing anything
    t0 = time.monotonic()
    try:
        _train(ddp, rank, 1)
    except Exception as exc:  # DDP re-raises the future's error from backward()
        later = st.worker.submit(lambda g: None)
        try:
            later.wait()
            again = "no error"
        except Exception as exc2:
            again = type(exc2).__name__ + ": " + str(exc2)
        return f"{time.monotonic() - t0:.1f}s {type(exc).__name__}: {exc} | then: {again}"
    return "no error"


@pytest.mark.slow
def test_hook_fails_clearly_when_a_peer_dies():
    out = run_ranks(_dying_rank, 2, timeout=120, allow_fail=True)
    status, msg = out[0]
    print(msg)
    assert status == "ok" and msg != "no error"
    assert "PeerClosed" in msg or "PeerTimeout" in msg or "closed" in msg
    assert float(msg.split("s ", 1)[0]) < 20
    assert "then: no error" not in msg, "a failed worker fails later jobs too"


# -- torchrun -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["gloo", pytest.param("dgt", marks=pytest.mark.slow)])
def test_torchrun_launches_the_example(backend):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "ddp_dgt.py"), "--steps", "5", "--hidden", "64", "--device", "cpu",
           "--backend", backend]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    print(proc.stdout[-2000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"done world=2 backend={backend} hook=dgt steps=5" in proc.stdout


# -- CUDA ---------------------------------------------------------------------------------------------------------
def _cuda_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dgt.shim

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for name, codec in (("gloo", None), ("dense", "dense"), ("dgt", "dgt:p=0.5")):
        ddp = DDP(_model().to(dev), device_ids=[dev.index], bucket_cap_mb=0.01)
        st = None
        if codec:
            st = dgt.shim.DGTState(codec=codec, warmup_iters=0)
            ddp.register_comm_hook(st, dgt.shim.hook)
        out[name + "_losses"] = _train(ddp, rank, STEPS, device=dev)
        out[name] = [p.detach().cpu() for p in ddp.module.parameters()]
        if st is not None:
            out[name + "_totals"] = dict(st.totals)
            st.close()
    dist.destroy_process_group()
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_hook_matches_gloo_and_trains():
    res = run_ranks(_cuda_rank, 2, timeout=240)
    for r in (0, 1):
        for a, b in zip(res[r]["dense"], res[r]["gloo"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert res[r]["dgt_totals"]["codec_buckets"] > 0
        assert all(v == v for v in res[r]["dgt_losses"])


def _backend_device_rank(rank: int, world: int, device: str) -> dict:
    """The ``dgt`` backend with tensors on ``device``: collectives, then DDP on the dgt group against DDP on Gloo."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dgt.shim  # noqa: F401  (registers the backend)

    dev = torch.device(device, rank % torch.cuda.device_count()) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("dgt", rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    out: dict = {}
    t = (torch.arange(5000, dtype=torch.float32) * (rank + 1)).to(dev)
    dist.all_reduce(t)
    out["sum"] = (t.device.type, t.cpu())
    a = torch.full((3,), float(rank + 1), device=dev)
    dist.all_reduce(a, op=dist.ReduceOp.AVG)
    out["avg"] = (a.device.type, a.cpu())
    b = torch.full((4,), float(rank), device=dev)
    dist.broadcast(b, src=1)
    out["bcast"] = (b.device.type, b.cpu())
    ids = [dev.index] if dev.type == "cuda" else None
    for name, pg in (("gloo", gloo), ("dgt", None)):
        ddp = DDP(_model().to(dev), device_ids=ids, bucket_cap_mb=0.01, process_group=pg)
        _train(ddp, rank, STEPS, device=dev)
        out[name] = [p.detach().cpu() for p in ddp.module.parameters()]
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_backend_on_the_tensors_device(device):
    """``init_process_group("dgt")`` with the model on ``device``: results stay there, and DDP on the dgt group
    trains exactly like DDP on Gloo (dense and lossless by default)."""
    res = run_ranks(_backend_device_rank, 2, device, timeout=240)
    for r in (0, 1):
        o = res[r]
        assert {o[k][0] for k in ("sum", "avg", "bcast")} == {device}
        torch.testing.assert_close(o["sum"][1], torch.arange(5000, dtype=torch.float32) * 3)
        torch.testing.assert_close(o["avg"][1], torch.full((3,), 1.5))
        assert o["bcast"][1].tolist() == [1.0] * 4
        for a, b in zip(o["dgt"], o["gloo"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_transport_settings_and_backend_codec_are_checked_when_given():
    """A mistyped transport field or codec is an error where the user wrote it (DGTState(...),
    DGTBackendOptions(...)), not one raised later in the first backward pass or collective on every rank."""
    from dgt.shim import DGTState
    from dgt.shim.backend import DGTBackendOptions

    with pytest.raises(TypeError, match="drop_fractoin"):
        DGTState(transport={"drop_fractoin": 0.1})
    with pytest.raises(ValueError, match="drop_fraction"):
        DGTState(transport={"drop_fraction": 2.0})
    with pytest.raises(TypeError, match="bogus"):
        DGTBackendOptions(transport={"bogus": 1})
    with pytest.raises(ValueError, match="unknown codec 'dgt2'"):
        DGTBackendOptions(codec="dgt2")
    st = DGTState(transport={"drop_fraction": 0.1})  # a valid dict is kept as given (built on first use)
    assert st.transport == {"drop_fraction": 0.1}
    assert DGTBackendOptions(codec="dgt:p=0.3").codec == "dgt:p=0.3"
