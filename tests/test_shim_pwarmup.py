"""The warm-up of DGT's p (``DGTState(p_warmup=N)``): the codec's ramp, the state's option, and the p the hook's
lossy rounds classify with, iteration by iteration, on two ranks."""

from __future__ import annotations

import pickle

import pytest
import torch

from dgt.codecs.registry import make_codec
from dgt.collectives.launch import run_ranks


def _important(codec, g: torch.Tensor) -> int:
    bs = codec.state_for(0, g, None)
    codec.encode(g, bs)
    return bs.values["last_important"]


def test_the_codec_ramps_p_from_one_to_the_schedule():
    codec = make_codec("dgt:p=0.1")
    g = torch.randn(100 * 1024, generator=torch.Generator().manual_seed(0))
    assert codec.ramp == 1.0 and codec.current_p() == pytest.approx(0.1)  # no warm-up: the schedule's p
    assert _important(codec, g) == 10
    codec.ramp = 0.0
    assert codec.current_p() == 1.0 and _important(codec, g) == 100  # every block important
    codec.ramp = 0.5
    assert codec.current_p() == pytest.approx(0.1 ** 0.5)
    assert _important(codec, g) == 32  # ceil(0.316 * 100)
    codec.ramp = 1.0
    assert _important(codec, g) == 10


def test_state_sets_the_ramp_by_iteration_and_checks_the_option():
    from dgt.shim import DGTState

    st = DGTState(p_warmup=4, chooser=None, warmup_iters=2)  # default codec (idle p = 0.1), dense warm-up of 2
    assert st.codec.ramp == 1.0  # nothing happens before a lossy round
    got = []
    for it in range(2, 8):
        st.warm_p(it)
        got.append(st.codec.current_p())
    assert got == pytest.approx([1.0, 0.1 ** 0.25, 0.1 ** 0.5, 0.1 ** 0.75, 0.1, 0.1])
    # with the chooser, p holds still through a probe window (the paths are timed at one p): its first window runs
    # iterations 2-9 (lossless, then lossy, 1 + 3 each on 2 modes: chooser=True, without the default's low-rank path)
    # at the p of iteration 2; the warm-up goes on after
    ch = DGTState(p_warmup=16, chooser=True, warmup_iters=2)
    assert [ch.chooser.window_first(it) for it in (1, 2, 9, 10)] == [None, 2, 2, None]
    got = []
    for it in (2, 5, 9, 10, 14):
        ch.warm_p(it)
        got.append(ch.codec.current_p())
    assert got == pytest.approx([1.0, 1.0, 1.0, 0.1 ** 0.5, 0.1 ** 0.75])
    st.warm_p(None)  # a round without an iteration number (submit() outside DDP) leaves the ramp alone
    assert st.codec.current_p() == pytest.approx(0.1)
    back = pickle.loads(pickle.dumps(st))
    assert back.p_warmup == 4
    old = st.__getstate__()
    del old["p_warmup"]  # a checkpoint from before the option
    fresh = DGTState.__new__(DGTState)
    fresh.__setstate__(old)
    assert fresh.p_warmup == 0
    # "auto": the README line warms p up over 50 iterations, an explicitly given codec does not
    assert DGTState().p_warmup == 50 and DGTState(codec="dgt:idle_p=0.1").p_warmup == 50  # (the default spelt out)
    assert DGTState(codec="dgt:p=0.1").p_warmup == 0
    assert DGTState(codec="dense").p_warmup == 0 and DGTState(p_warmup=0).p_warmup == 0
    with pytest.raises(ValueError, match="p_warmup"):
        DGTState(p_warmup="soon")
    with pytest.raises(ValueError, match="p_warmup"):
        DGTState(p_warmup=-1)
    with pytest.raises(ValueError, match="has none"):
        DGTState(codec="dense", p_warmup=10)
    with pytest.raises(ValueError, match="has none"):
        DGTState(codec="qsgd", p_warmup=10)


def _hook_p_per_iteration(rank: int, world: int) -> list[float | None]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dgt.shim

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 4))
    ddp = DDP(model)
    st = dgt.shim.DGTState(codec="dgt:idle_p=0.1", chooser=None, warmup_iters=1, p_warmup=4)
    ddp.register_comm_hook(st, dgt.shim.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    ps = []
    for _ in range(7):
        x = torch.randn(16, 64, generator=gen)
        loss = ddp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ps.append(st.last_stats[0].get("p"))
    st.close()
    dist.destroy_process_group()
    return ps


def test_the_hooks_lossy_rounds_follow_the_warm_up():
    """Iteration 0 is the dense warm-up (no p); from iteration 1 the lossy rounds classify with 0.1 ** (t / 4),
    t = it - 1, on both ranks, and with the schedule's 0.1 from t = 4 on."""
    want = [None, 1.0, 0.1 ** 0.25, 0.1 ** 0.5, 0.1 ** 0.75, 0.1, 0.1]
    runs = run_ranks(_hook_p_per_iteration, 2, timeout=120)
    assert sorted(runs) == [0, 1]
    for ps in runs.values():
        assert ps[0] is None
        assert ps[1:] == pytest.approx(want[1:])
