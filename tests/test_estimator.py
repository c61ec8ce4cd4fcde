"""The contribution estimator against a naive per-block reference, classification counts, and the p schedules."""

import math

import pytest
import torch

from dgt.estimator import ContributionEstimator, expected_important
from dgt.layout import BucketLayout
from dgt.p_schedule import ConstantP, LossProportionalP, make_schedule

AWKWARD = [[1], [1023], [1024], [1025], [3000, 5, 0, 4096, 70001], [17, 2049, 1]]


def naive_scores(sizes, n, grads, alpha):
    """Eq. 1 with explicit loops: C = alpha*C + (1-alpha)*mean|g| per block of each tensor."""
    c = None
    for g in grads:
        cur = []
        off = 0
        for s in sizes:
            for j in range(math.ceil(s / n)):
                blk = g[off + j * n : off + min((j + 1) * n, s)]
                cur.append(float(blk.abs().double().mean()))
            off += s
        c = [(1 - alpha) * x for x in cur] if c is None else [alpha * a + (1 - alpha) * b for a, b in zip(c, cur)]
    return torch.tensor(c, dtype=torch.float64)


@pytest.mark.parametrize("sizes", AWKWARD)
@pytest.mark.parametrize("n", [1024, 100])
def test_estimator_matches_naive_reference(sizes, n):
    torch.manual_seed(sum(sizes) + n)
    layout = BucketLayout(sizes, n)
    est = ContributionEstimator(layout, alpha=0.3)
    grads = [torch.randn(layout.numel) * (i + 1) for i in range(3)]
    for g in grads:
        got = est.update(g)
    ref = naive_scores(sizes, n, grads, 0.3)
    assert got.shape == ref.shape
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)


def test_first_round_is_one_minus_alpha_times_mean():
    layout = BucketLayout([2048])
    est = ContributionEstimator(layout, alpha=0.3)
    g = torch.cat([torch.full((1024,), 2.0), torch.full((1024,), -1.0)])
    torch.testing.assert_close(est.update(g), torch.tensor([1.4, 0.7]))


def naive_important(sizes, n, scores, p):
    out = []
    first = 0
    for s in sizes:
        nb = math.ceil(s / n)
        k = min(nb, math.ceil(nb * p))
        if p > 0 and nb > 0:
            k = max(k, 1)
        sc = scores[first : first + nb].tolist()
        top = sorted(range(nb), key=lambda j: (-sc[j], j))[:k]
        out += [j in top for j in range(nb)]
        first += nb
    return torch.tensor(out, dtype=torch.bool)


@pytest.mark.parametrize("sizes", AWKWARD)
@pytest.mark.parametrize("p", [0.0, 0.01, 0.3, 0.5, 1.0])
def test_classification_top_p_per_tensor(sizes, p):
    torch.manual_seed(1)
    layout = BucketLayout(sizes, 256)
    est = ContributionEstimator(layout)
    est.update(torch.randn(layout.numel))
    c = est.classify(p)
    ref = naive_important(sizes, 256, c.scores, p)
    assert torch.equal(c.important, ref)
    assert c.n_important == expected_important(layout, p)
    # unimportant order: exactly the unimportant blocks, scores non-increasing
    assert sorted(c.order.tolist()) == torch.nonzero(~ref).flatten().tolist()
    assert torch.all(c.scores[c.order][:-1] >= c.scores[c.order][1:])
    assert torch.equal(c.cls == 0, c.important)


def test_p_zero_marks_nothing_p_one_marks_everything_and_one_block_minimum():
    layout = BucketLayout([5000, 10, 1024 * 50])
    est = ContributionEstimator(layout)
    est.update(torch.randn(layout.numel))
    assert est.classify(0.0).n_important == 0
    assert est.classify(1.0).n_important == layout.nblocks
    c = est.classify(1e-9)  # tiny p still keeps one block per tensor
    assert c.n_important == 3
    for k in range(3):
        assert int(c.important[layout.blocks_of_tensor(k)].sum()) == 1


def test_more_lane_classes_split_unimportant_by_rank():
    layout = BucketLayout([1024 * 100])
    est = ContributionEstimator(layout, classes=4)
    est.update(torch.arange(layout.numel, dtype=torch.float32))  # later blocks score higher
    c = est.classify(0.1)
    assert c.n_important == 10
    classes = c.cls[c.order]
    assert torch.all(classes[:-1] <= classes[1:])  # descending score -> ascending class
    assert set(classes.tolist()) == {1, 2, 3}
    assert torch.all(c.cls[90:] == 0)


def test_layout_change_needs_new_estimator_and_wrong_size_is_rejected():
    est = ContributionEstimator(BucketLayout([100]))
    with pytest.raises(ValueError):
        est.update(torch.randn(101))


def test_bfloat16_and_half_buckets():
    layout = BucketLayout([3000])
    for dt in (torch.float16, torch.bfloat16):
        g = torch.randn(3000).to(dt)
        s = ContributionEstimator(layout).update(g)
        ref = naive_scores([3000], 1024, [g.float()], 0.3).float()
        torch.testing.assert_close(s, ref, rtol=1e-2, atol=1e-3)


def test_constant_and_loss_schedules():
    assert ConstantP(0.3).p() == 0.3
    with pytest.raises(ValueError):
        ConstantP(1.5)
    s = LossProportionalP(p0=1.0, p_min=0.1)
    assert s.p() == 1.0  # no loss seen yet
    s.observe_loss(2.0)
    assert s.p() == 1.0
    s.observe_loss(1.0)
    assert s.p() == pytest.approx(0.5)
    s.observe_loss(float("nan"))  # ignored
    assert s.p() == pytest.approx(0.5)
    s.observe_loss(0.01)
    assert s.p() == pytest.approx(0.1)  # clamped at p_min
    s.observe_loss(10.0)
    assert s.p() == 1.0  # clamped at 1
    assert isinstance(make_schedule("loss:p0=0.5"), LossProportionalP)
    assert make_schedule("0.25").p() == 0.25
    assert make_schedule("const:0.4").p() == 0.4
    with pytest.raises(ValueError):
        make_schedule("bogus")


def test_loss_schedule_idle_p_until_a_loss_is_observed():
    s = make_schedule("loss:p0=1,p_min=0.05,idle_p=0.3")
    assert s.p() == pytest.approx(0.3)  # no loss fed (the DDP hook's one-line change): still drops
    s.observe_loss(float("nan"))  # a non-finite loss is no observation
    assert s.p() == pytest.approx(0.3)
    s.observe_loss(2.0)
    assert s.p() == 1.0  # fed: the paper's p0 * loss_t / loss_0 from its start p0
    s.observe_loss(0.5)
    assert s.p() == pytest.approx(0.25)
    assert LossProportionalP(p0=0.8).p() == pytest.approx(0.8)  # idle_p unset: p0, as before
    assert LossProportionalP(p_min=0.2, idle_p=0.1).p() == pytest.approx(0.2)  # clamped like any p
    with pytest.raises(ValueError):
        LossProportionalP(idle_p=1.5)



@pytest.mark.parametrize("classes", [2, 3, 5])
@pytest.mark.parametrize("p", [0.0, 0.001, 0.3, 0.999, 1.0])
def test_one_tensor_numpy_path_matches_the_general_one(classes, p):
    """A one-tensor CPU bucket is ranked in numpy (one stable sort); it gives exactly what the torch path does,
    ties included (a run of zero blocks keeps block order in both), and NaN scores go to the torch path."""
    layout = BucketLayout([200 * 1024 + 17])
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(3))
    x[: 40 * 1024] = 0.0  # 40 tied blocks
    est = ContributionEstimator(layout, classes=classes)
    est.update(x)
    fast = est.classify(p)
    est._classify_one_tensor = lambda s, p: None  # type: ignore[method-assign]
    general = est.classify(p)
    for a, b in ((fast.important, general.important), (fast.order, general.order), (fast.cls, general.cls)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert fast.n_important == expected_important(layout, p)
    del est._classify_one_tensor
    scores = est.scores.clone()
    scores[5] = float("nan")
    assert est._classify_one_tensor(scores, p) is None  # numpy and torch rank NaN differently
    assert bool(est.classify(p, scores).important[5]) == (p > 0)  # torch: NaN ranks first


def test_block_abs_mean_c_pass_matches_its_twin():
    layout = BucketLayout([3 * 1024 + 5, 1024, 7])
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(4))
    fast, twin = layout.block_abs_mean(x), layout.block_abs_mean(x, native=False)
    assert fast.dtype == twin.dtype == torch.float32 and fast.shape == (layout.nblocks,)
    torch.testing.assert_close(fast, twin, rtol=1e-6, atol=0)
    with pytest.raises(ValueError):
        layout.block_abs_mean(x[:-1])

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_scores_restored_on_the_cpu_carry_over_to_cuda():
    layout = BucketLayout([5000, 3000])
    x = torch.randn(layout.numel)
    est = ContributionEstimator(layout)
    est.update(x)
    saved = est.scores.clone()  # as a checkpoint holds them: on the CPU
    est.update(x.cuda())  # the next round runs on the GPU: the average goes on, it does not restart
    torch.testing.assert_close(est.scores.cpu(), 0.3 * saved + 0.7 * layout.block_abs_mean(x))
