"""The DDP hook with the low-rank codec (``DGTState(codec="lowrank:rank=1")``, issue 42 point 3): PowerSGD factors
over DGT's transport through ``dgt.shim.hook``.

One spawn of 3 ranks (loopback, a Gloo group for DDP) runs a small conv + linear model through the hook: with the
P/Q reductions on the ring and on the direct all-reduce, with the DGT residual split, and a bucket id past the
low-rank all-reduce's range. Every call's input, output and error feedback is recorded, and the parent checks that
every rank applied the same bits, that each output is what the codec computes in process
(:func:`~dgt.codecs.lowrank.reduce_in_process` fed the same inputs), and conservation (what was applied + what error
feedback holds = the inputs + the error feedback before).
"""

from __future__ import annotations

import math

import pytest
import torch

from dgt.codecs.base import BucketState
from dgt.codecs.lowrank import reduce_in_process, set_shapes
from dgt.codecs.registry import make_codec
from dgt.collectives.launch import run_ranks

WORLD = 3
STEPS = 6
CHOOSE_STEPS = 16  # chooser: warm-up 1, window 1-5 (low rank first), low rank 6-7, re-probe 8-11, low rank 12-15


def _model() -> torch.nn.Module:
    """Conv weights (8 x 3 x 3 x 3: read as 8 x 27), linear matrices and biases (1-D, sent dense)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 6 * 6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(16, 3, 8, 8, generator=gen), torch.randint(4, (16,), generator=gen)) for _ in range(steps)]


def _recording(log: list[dict]):
    """dgt.shim.hook, recording each call: iteration, bucket index, shapes, input, whether the codec's state was
    cleared (DDP rebuilt its buckets), the output, the chooser's mode (None without a chooser) and the low-rank
    codec's error feedback of that bucket after the call (the configured codec's, or the chooser's low-rank path's)."""
    import dgt.shim
    from dgt.shim.chooser import LOWRANK
    from dgt.shim.state import LOWRANK_BUCKETS

    def rec_hook(state, bucket):
        before = state._clear_iter
        entry = {"iter": state.iter, "index": bucket.index(), "input": bucket.buffer().clone(),
                 "shapes": [tuple(g.shape) for g in bucket.gradients()], "codec": state.past_warmup}
        fut = dgt.shim.hook(state, bucket)
        entry["clear"] = state._clear_iter != before

        def done(f):  # (run by the worker as it completes this call, before its next job)
            out = f.value()
            entry["output"] = out.clone()
            entry["mode"] = None if state.chooser is None or not entry["codec"] else \
                state.last_stats[entry["index"]]["mode"]  # (this call's: the chooser's schedule moved on at a decision)
            if entry["mode"] == LOWRANK:
                st = state.lowrank_codec.state_dict().get(LOWRANK_BUCKETS + entry["index"])
            else:
                st = state.codec.state_dict().get(entry["index"])
            ef = None if st is None else st.values.get("ef")
            entry["ef"] = None if ef is None or not entry["codec"] else ef.clone()
            log.append(entry)
            return out

        return fut.then(done)

    return rec_hook


def _train(rank: int, state, steps: int, bucket_cap_mb: float = 0.005) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(_model(), bucket_cap_mb=bucket_cap_mb)
    log: list[dict] = []
    ddp.register_comm_hook(state, _recording(log))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for x, y in _batches(rank, steps):
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert state._collectives is not None
    warm, main = state._collectives
    out = {"log": log, "params": [p.detach().clone() for p in ddp.module.parameters()],
           "totals": dict(state.totals), "resets": state.bucket_resets, "iter": state.iter,
           "decisions": None if state.chooser is None else list(state.chooser.decisions),
           "collectives": (type(warm).__name__, type(main).__name__, getattr(main, "inner", None))}
    state.close()
    return out


def _ranks(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import dgt.shim
    from dgt.shim.chooser import LOSSLESS, LOSSY, LOWRANK, DropChooser
    from dgt.shim.hook import submit

    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict = {}
    # the ring, no warm-up: DDP's bucket rebuild after iteration 1 hits the codec
    out["ring"] = _train(rank, dgt.shim.DGTState(codec="lowrank:rank=1", collective="ring", warmup_iters=0), STEPS)
    # the direct all-reduce for P and Q (collective="auto" picks it), after 2 dense iterations
    out["direct"] = _train(rank, dgt.shim.DGTState(codec="lowrank:rank=1", warmup_iters=2), STEPS)
    # the DGT residual split: the state turns the transport's error feedback off
    st = dgt.shim.DGTState(codec="lowrank:rank=1,residual_p=0.3,block=64", warmup_iters=1)
    out["residual_transport"] = st.transport
    out["residual"] = _train(rank, st, 4)
    # the default hook whose chooser also has the low-rank path, with a steps prior that makes it win; one iteration
    # per mode in the probe windows (on 3 ranks: the ring and the direct all-reduce, lossless and lossy, and low rank)
    # (skip=inf, screen=inf: every other path is re-probed in full, though each lost by far more than the default
    # skip and screen factors)
    ch = DropChooser(start=1, probe=1, settle=0, hold=2, modes=(LOSSLESS, LOSSY, LOWRANK), lowrank_steps=1e-6,
                     skip=math.inf, screen=math.inf)
    out["chosen"] = _train(rank, dgt.shim.DGTState(chooser=ch, warmup_iters=1), CHOOSE_STEPS)
    # a bucket id past the low-rank all-reduce's range: a clear error on every rank, no hang
    st = dgt.shim.DGTState(codec="lowrank:rank=1", warmup_iters=0)
    try:
        submit(st, torch.ones(12), 6000, shapes=[(3, 4)]).wait()
        out["big_id"] = "no error"
    except Exception as exc:
        out["big_id"] = f"{type(exc).__name__}: {exc}"
    st.close()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_ranks, WORLD, timeout=300)


def _calls(runs, variant):
    """The calls of every rank, in the same order (every rank's hook sees the buckets in the same order)."""
    logs = [runs[r][variant]["log"] for r in range(WORLD)]
    assert len({len(lg) for lg in logs}) == 1
    for k in range(len(logs[0])):
        assert len({(lg[k]["iter"], lg[k]["index"]) for lg in logs}) == 1
    return list(zip(*logs))


@pytest.mark.parametrize("variant", ["ring", "direct"])
def test_every_rank_applies_the_same_bits_and_the_codecs_mean(runs, variant):
    calls = _calls(runs, variant)
    warm = 0 if variant == "ring" else 2
    # the dense warm-up on the ring; P and Q on the ring (collective="ring") or the direct all-reduce ("auto")
    assert runs[0][variant]["collectives"] == ("RingAllReduce", "LowRankAllReduce", variant)
    assert runs[0][variant]["iter"] == STEPS
    indices = {c[0]["index"] for c in calls}
    assert len(indices) >= 2, "the small bucket cap gives DDP several buckets"
    for call in calls:
        c0 = call[0]
        for c in call[1:]:  # the same output, bit for bit, on every rank
            assert torch.equal(c["output"], c0["output"]), (c0["iter"], c0["index"])
        if not c0["codec"]:  # the dense warm-up: the plain mean
            assert c0["iter"] < warm
            torch.testing.assert_close(c0["output"], sum(c["input"] for c in call) / WORLD, rtol=1e-5, atol=1e-6)
        else:
            assert c0["iter"] >= warm
    assert _check_low_rank_calls([c for c in calls if c[0]["codec"]], "lowrank:rank=1") > 0, \
        "conv and linear weights were compressed"
    for r in range(1, WORLD):  # the replicas stay identical
        for a, b in zip(runs[r][variant]["params"], runs[0][variant]["params"]):
            assert torch.equal(a, b)
    t = runs[0][variant]["totals"]
    assert t["codec_buckets"] == sum(1 for c in calls if c[0]["codec"]) > 0
    assert t["bytes_sent"].get(0, 0) > 0 and t["bytes_sent"].get(1, 0) == 0 and t["dropped"] == 0


def _check_low_rank_calls(calls, spec: str) -> int:
    """Every call of ``calls`` (each a tuple of the ranks' entries, in order) ran the low-rank codec ``spec``: its
    output is what :func:`reduce_in_process` computes from the same inputs and the same per-bucket history (cleared
    where the hook cleared), the hook's error feedback is the reference's, and conservation holds over the ranks.
    Returns the number of matrices compressed."""
    matrices = 0
    # the in-process reference: one codec per rank, one state per (rank, bucket), cleared where the hook cleared
    codecs = [make_codec(spec) for _ in range(WORLD)]
    states: list[dict[int, BucketState]] = [{} for _ in range(WORLD)]
    for call in calls:
        c0 = call[0]
        inputs = [c["input"] for c in call]
        if any(c["clear"] for c in call):
            assert all(c["clear"] for c in call)
            for r in range(WORLD):
                states[r].clear()
        sts = []
        for r in range(WORLD):
            st = states[r].get(c0["index"])
            if st is None or st.numel != inputs[r].numel():
                st = states[r][c0["index"]] = BucketState(inputs[r].numel(), inputs[r].dtype)
            set_shapes(st, call[r]["shapes"])
            sts.append(st)
        matrices += len(codecs[0].plan(sts[0]).matrices)
        ef_before = [st.values.get("ef", torch.zeros_like(x)).clone() for st, x in zip(sts, inputs)]
        ref = reduce_in_process(codecs, sts, inputs)[0] / WORLD
        torch.testing.assert_close(c0["output"], ref, rtol=1e-4, atol=1e-5)
        # the hook's own codec state: the same error feedback as the reference's, and conservation over the ranks
        applied = c0["output"] * WORLD
        ef_after = [c["ef"] for c in call]
        for r in range(WORLD):
            torch.testing.assert_close(ef_after[r], sts[r].values["ef"], rtol=1e-4, atol=1e-5)
        lhs = applied + sum(ef_after)
        rhs = sum(inputs) + sum(ef_before)
        # (a bfloat16 wire: the reduced payload's one rounding, 2^-9 relative, is not carried over; docs/codecs.md)
        tol = 1e-5 if codecs[0].wire_dtype is None else 2 ** -7
        assert float((lhs - rhs).abs().max()) <= tol * max(1.0, float(rhs.abs().max())), (c0["iter"], c0["index"])
        # compression happened: the error feedback is not all zero once a matrix was approximated
        if codecs[0].plan(sts[0]).matrices:
            assert any(bool(e.any()) for e in ef_after)
    return matrices


def test_the_chooser_can_pick_the_low_rank_path_and_every_rank_applies_the_same_bits(runs):
    """DGTState(chooser=...) with the LOWRANK mode: the ranks probe five paths, agree, pick low rank (its steps
    prior set to win here), re-probe the others and keep it; every call gives every rank the same bits, the low-rank
    calls are the codec's mean with conservation, over its own bucket ids, and the other paths still average."""
    from dgt.shim.chooser import ALL_MODES, LOWRANK
    from dgt.shim.state import CHOOSER_LOW_RANK

    calls = _calls(runs, "chosen")
    r0 = runs[0]["chosen"]
    assert all(repr(runs[r]["chosen"]["decisions"]) == repr(r0["decisions"]) for r in range(WORLD)), "agreed decisions"
    assert [d["chosen"] for d in r0["decisions"]] == [LOWRANK, LOWRANK]
    assert set(r0["decisions"][0]["seconds"]) == set(ALL_MODES) | {LOWRANK}  # offered on 3 ranks: all five
    assert r0["decisions"][0]["lowrank_weighed_s"] < min(r0["decisions"][0]["seconds"].values())
    modes = [c[0]["mode"] for c in calls]
    for call in calls:
        for c in call[1:]:
            assert torch.equal(c["output"], call[0]["output"]), (call[0]["iter"], call[0]["index"], call[0]["mode"])
    assert {m for m in modes if m is not None} == set(ALL_MODES) | {LOWRANK}
    low = [c for c in calls if c[0]["mode"] == LOWRANK]
    assert {c[0]["iter"] for c in low} == {1, 6, 7, 12, 13, 14, 15}  # the window's first: the screened order
    assert _check_low_rank_calls(low, CHOOSER_LOW_RANK) > 0
    for call in calls:  # the lossless paths (warm-up, probes) are the plain mean; lossy ones are finite
        mean = sum(c["input"] for c in call) / WORLD
        if call[0]["mode"] in (None, "lossless", "lossless-direct"):
            torch.testing.assert_close(call[0]["output"], mean, rtol=1e-5, atol=1e-6)
        assert torch.isfinite(call[0]["output"]).all()
    for r in range(1, WORLD):
        for a, b in zip(runs[r]["chosen"]["params"], r0["params"]):
            assert torch.equal(a, b)
    paths = r0["totals"]["paths"]
    assert paths[LOWRANK]["buckets"] == len(low) and paths["lossy"]["buckets"] > 0
    assert r0["totals"]["choice"]["iters"][LOWRANK] == 3  # the summary as of the last decision (iteration 11)


def test_bucket_rebuild_resets_the_codec_and_the_factors_are_smaller(runs):
    calls = _calls(runs, "ring")
    # DDP rebuilt its buckets after iteration 1: the state saw it and the hook cleared the codec's bucket states
    assert runs[0]["ring"]["resets"] >= 1
    assert any(c[0]["clear"] for c in calls) and all(c[0]["iter"] == 1 for c in calls if c[0]["clear"])
    # what went on the wire past the warm-up is far less than the dense buckets (rank-1 factors of the matrices)
    dense = sum(c[0]["input"].numel() * 4 for c in calls) * 2 * (WORLD - 1) / WORLD
    sent = runs[0]["ring"]["totals"]["bytes_sent"][0]
    print(f"low-rank hook (ring): {sent} B sent by rank 0 vs {dense:.0f} B for a dense ring")
    assert sent < dense / 3


def test_residual_variant_runs_with_the_transports_error_feedback_off(runs):
    from dgt.transport import TransportConfig

    for r in range(WORLD):
        assert runs[r]["residual_transport"] == {"error_feedback": False}
        assert TransportConfig(**runs[r]["residual_transport"]).error_feedback is False
    calls = _calls(runs, "residual")
    for call in calls:
        for c in call[1:]:
            assert torch.equal(c["output"], call[0]["output"])
    for r in range(1, WORLD):
        for a, b in zip(runs[r]["residual"]["params"], runs[0]["residual"]["params"]):
            assert torch.equal(a, b)
    t = runs[0]["residual"]["totals"]
    assert t["codec_buckets"] > 0 and t["bytes_sent"].get(1, 0) > 0  # residual blocks on the droppable lane


def test_a_bucket_id_past_the_low_rank_range_is_a_clear_error(runs):
    for r in range(WORLD):
        msg = runs[r]["big_id"]
        # the hook's future carries the worker's error (torch wraps it in a RuntimeError naming it)
        assert "InputRejected: bucket id 6000 outside 0..5460" in msg, msg


# -- no network ---------------------------------------------------------------------------------------------------
def test_state_options_the_low_rank_codec_takes_and_refuses():
    from dgt.shim import DGTState
    from dgt.transport import TransportConfig

    st = DGTState(codec="lowrank:rank=1")
    assert st.low_rank and st.chooser is None and st.wire_dtype is None and st.transport is None
    assert st.collective == "auto" and st.warmup_iters == 1
    assert not DGTState().low_rank and not DGTState(codec="dense").low_rank
    assert DGTState(codec="lowrank", wire_dtype="native", chooser=None).chooser is None
    with pytest.raises(ValueError, match="parameter server"):
        DGTState(codec="lowrank:rank=1", collective="ps")
    with pytest.raises(ValueError, match="no chooser"):
        DGTState(codec="lowrank:rank=1", chooser=True)
    with pytest.raises(ValueError, match="no wire_dtype"):
        DGTState(codec="lowrank:rank=1", wire_dtype="fp16")
    # the residual split: the transport's error feedback off, set by the state or refused when asked for
    spec = "lowrank:rank=1,residual_p=0.1"
    assert DGTState(codec=spec).transport == {"error_feedback": False}
    assert DGTState(codec=spec, transport={"drop_fraction": 0.1}).transport == {"drop_fraction": 0.1,
                                                                                 "error_feedback": False}
    assert DGTState(codec=spec, transport=TransportConfig(error_feedback=False)).transport.error_feedback is False
    with pytest.raises(ValueError, match="error feedback off"):
        DGTState(codec=spec, transport={"error_feedback": True})
    with pytest.raises(ValueError, match="error_feedback=False"):
        DGTState(codec=spec, transport=TransportConfig())
    # without the residual the transport is left as given
    assert DGTState(codec="lowrank", transport={"drop_fraction": 0.1}).transport == {"drop_fraction": 0.1}


def test_shapes_of_conv_weights_are_read_as_out_by_rest():
    codec = make_codec("lowrank:rank=1")
    shapes = [tuple(p.shape) for p in _model().parameters()]
    st = BucketState(sum(math.prod(s) for s in shapes), torch.float32)
    set_shapes(st, shapes)
    mats = codec.plan(st).matrices
    assert [(m.rows, m.cols) for m in mats] == [(8, 27), (32, 288), (4, 32)]


def test_a_low_rank_state_pickles_with_its_factors_and_error_feedback():
    import pickle

    from dgt.shim import DGTState

    st = DGTState(codec="lowrank:rank=1,residual_p=0.2,block=16")
    g = torch.randn(40 * 30 + 30, generator=torch.Generator().manual_seed(0))
    bs = st.codec.state_for(0, g)
    set_shapes(bs, [(40, 30), (30,)])
    reduce_in_process([st.codec], [bs], [g])
    back = pickle.loads(pickle.dumps(st))
    assert back.low_rank and back.transport == {"error_feedback": False} and back.chooser is None
    vals = back.codec.state_dict()[0].values
    assert torch.equal(vals["ef"], bs.values["ef"]) and bool(vals["ef"].any())
    assert torch.equal(vals["q"][0], bs.values["q"][0])  # the warm start survives the checkpoint
