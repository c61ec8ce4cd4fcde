"""Fast tests of learned gradient compression (dgt.codecs.lgc): comm, wire formats, plan, autoencoder, codec, runner."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

import dgt.codecs.lgc  # noqa: F401  (registers "lgc")
from dgt.codecs.base import Received
from dgt.codecs.lgc import LGCCodec, LGCRunner
from dgt.codecs.lgc.autoencoder import (
    Decoder,
    Encoder,
    PSAutoencoder,
    RingAutoencoder,
    latent_numel,
    padded_length,
    to_signal,
)
from dgt.codecs.lgc.plan import LayerPlan, LGCConfig, Phase
from dgt.codecs.lgc.wire import (
    decode_index_list,
    decode_indices,
    encode_index_list,
    encode_indices,
    entry_overhead,
    flatten_module_state,
    load_module_state,
    pack,
    unpack,
)
from dgt.codecs.registry import _REGISTRY, parse_spec
from dgt.harness.local_comm import LocalGroup, run_threads

torch.set_num_threads(1)

# awkward sizes: a 1-element layer, odd sizes, sizes around the multiple of 16 the AE pads to
AWKWARD = [7, 1, 4999, 17, 20001, 1025, 513]


def _registry_codec(spec: str) -> LGCCodec:
    # make_codec() imports every built-in codec module; use the registry entry directly so these tests do not depend
    # on other codecs being importable.
    name, kwargs = parse_spec(spec)
    return _REGISTRY[name](**kwargs)


# -- registry / config --------------------------------------------------------------------------------------------
def test_registered_with_options_and_capabilities():
    ps = _registry_codec("lgc:variant=ps,warmup=200,ae_iters=300,topk=0.001")
    assert isinstance(ps, LGCCodec)
    assert (ps.config.warmup, ps.config.ae_iters, ps.config.topk) == (200, 300, 0.001)
    assert not ps.capabilities.summable and ps.capabilities.stateful_server and not ps.capabilities.lossy_tolerant
    ring = _registry_codec("lgc:variant=ring,momentum_correction=true")
    assert ring.capabilities.summable and not ring.capabilities.stateful_server
    assert ring.config.momentum_correction is True
    with pytest.raises(ValueError, match="unknown lgc option"):
        _registry_codec("lgc:variant=ps,bogus=1")
    with pytest.raises(ValueError):
        _registry_codec("lgc:variant=tree")


def test_phase_schedule():
    cfg = LGCConfig(warmup=3, ae_iters=4)
    assert [cfg.phase(i) for i in range(9)] == [Phase.DENSE] * 3 + [Phase.TOPK] * 4 + [Phase.COMPRESSED] * 2
    assert cfg.switch_step == 7


# -- comm ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 1001])
def test_local_comm_allreduce_sum_and_bytes(world, n):
    def body(comm):
        t = torch.arange(n, dtype=torch.float32) * (comm.rank + 1)
        return comm.allreduce_sum(t, tag="x"), comm.stats.sent["x"]

    res = run_threads(body, world)
    expect = torch.arange(n, dtype=torch.float32) * sum(range(1, world + 1))
    for out, _ in res:
        assert torch.equal(out, expect)
    # ring all-reduce: every element crosses 2 (K - 1) links in all
    assert sum(b for _, b in res) == 2 * (world - 1) * n * 4


def test_local_comm_other_collectives_count_bytes():
    def body(comm):
        r = comm.rank
        g = comm.allgather(torch.full((r + 1,), float(r)), tag="ag")
        b = comm.broadcast(torch.arange(5, dtype=torch.int32) if r == 1 else None, 1, tag="bc")
        got = comm.gather_to(0, torch.full((2,), r, dtype=torch.int64), tag="ga")
        if r == 2:
            comm.send_to(0, torch.ones(3), tag="p2p")
        p = comm.recv_from(2, tag="p2p") if r == 0 else None
        return g, b, got, p, dict(comm.stats.sent)

    res = run_threads(body, 3)
    for r, (g, b, _got, _p, sent) in enumerate(res):
        assert [t.tolist() for t in g] == [[0.0], [1.0, 1.0], [2.0, 2.0, 2.0]]
        assert b.tolist() == [0, 1, 2, 3, 4]
        assert sent["ag"] == (r + 1) * 4 * 2  # to the two other ranks
        assert sent.get("bc", 0) == (20 * 2 if r == 1 else 0)
        assert sent.get("ga", 0) == (0 if r == 0 else 16)
        assert sent.get("p2p", 0) == (12 if r == 2 else 0)
    assert [t.tolist() for t in res[0][2]] == [[0, 0], [1, 1], [2, 2]]
    assert res[1][2] is None and res[0][3].tolist() == [1.0, 1.0, 1.0]


def test_local_comm_implements_the_protocol():
    from dgt.codecs.lgc import Comm

    assert all(isinstance(c, Comm) for c in LocalGroup(2).comms)


def test_run_threads_propagates_errors_without_hanging():
    def body(comm):
        if comm.rank == 1:
            raise RuntimeError("boom")
        comm.allreduce_sum(torch.ones(4), tag="x")

    with pytest.raises(RuntimeError, match="boom"):
        run_threads(body, 3, timeout=20)
    assert LocalGroup(2).comms[1].rank == 1


# -- wire ---------------------------------------------------------------------------------------------------------
def test_pack_roundtrip_and_header_size():
    ts = [torch.randn(5), torch.tensor([3], dtype=torch.uint8), torch.arange(300, dtype=torch.int64),
          torch.zeros(0), torch.randn(7).half()]
    frame = pack(ts)
    assert frame.dtype == torch.uint8
    assert frame.numel() == 1 + sum(t.numel() * t.element_size() + entry_overhead(t.numel() * t.element_size())
                                    for t in ts)
    back = unpack(frame)
    assert len(back) == len(ts)
    for a, b in zip(ts, back):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("idx", [[], [0], [5, 6, 7], [0, 70000, 70001, 2**33], list(range(0, 100000, 97))])
def test_index_coding_roundtrip(idx):
    t = torch.tensor(idx, dtype=torch.int64)
    buf = encode_indices(t)
    assert buf.dtype == torch.uint8
    assert torch.equal(decode_indices(buf), t)


@pytest.mark.parametrize("idx", [[], [0], [9, 3, 5], [70000, 5, 2**33, 12], list(range(100000, 0, -7))])
def test_ordered_index_list_roundtrip(idx):
    t = torch.tensor(idx, dtype=torch.int64)
    buf = encode_index_list(t)
    assert buf.dtype == torch.uint8 and torch.equal(decode_index_list(buf), t)


def test_ordered_index_list_costs():
    gen = torch.Generator().manual_seed(0)
    small = torch.randperm(56000, generator=gen)[:57]  # the bench's AE layers: absolute u16 = sorted u16 deltas
    assert encode_index_list(small).numel() == 1 + 2 * 57 == encode_indices(small.sort().values).numel()
    big = torch.randperm(4_000_000, generator=gen)[:4000]  # large buckets: sorted set + u16 permutation wins
    assert encode_index_list(big).numel() < 1 + 4 * 4000


def test_index_coding_deflates_regular_sets():
    idx = torch.arange(0, 200000, 50)  # 4000 indices, constant delta: DEFLATE must beat 1 byte/index easily
    buf = encode_indices(idx)
    assert buf[0].item() & 1 == 1  # DEFLATE chosen
    assert buf.numel() < 200
    with pytest.raises(ValueError):
        encode_indices(torch.tensor([3, 1]))


# -- plan ---------------------------------------------------------------------------------------------------------
def test_layer_plan_exact_k_and_roles():
    plan = LayerPlan(AWKWARD, topk=0.001)
    assert plan.roles == ("dense",) + ("ae",) * 5 + ("topk",)
    assert plan.k == (7, 1, 5, 1, 21, 2, 1)
    assert plan.mu("ae") == 1 + 5 + 1 + 21 + 2 and plan.mu("topk") == 1
    v = torch.randn(plan.numel)
    idx = plan.select(v, "ae")
    assert idx.numel() == plan.mu("ae") and torch.all(idx[1:] > idx[:-1])
    for i in plan.layers("ae"):  # exactly k per layer, and they are that layer's largest magnitudes
        lo, hi = plan.offsets[i], plan.offsets[i] + plan.sizes[i]
        mine = idx[(idx >= lo) & (idx < hi)]
        assert mine.numel() == plan.k[i]
        assert v[mine].abs().min() >= torch.topk(v[lo:hi].abs(), plan.k[i]).values.min()
    assert LayerPlan([10]).roles == ("ae",) and LayerPlan([10, 20]).roles == ("dense", "topk")
    with pytest.raises(ValueError):
        LayerPlan([3, 0])


# -- autoencoder --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mu", [1, 15, 16, 17, 31, 57, 1000, 4097])
def test_autoencoder_shapes(mu):
    x = torch.randn(3, mu)
    enc, dec, dec_i = Encoder(), Decoder(), Decoder(innovation=True)
    code = enc(to_signal(x))
    assert code.shape == (3, 4, padded_length(mu) // 16)
    assert code[0].numel() == latent_numel(mu) and padded_length(mu) % 16 == 0
    assert dec(code).shape == (3, 1, padded_length(mu))
    assert dec_i(code, to_signal(x[0])).shape == (3, 1, padded_length(mu))
    ps = PSAutoencoder(2)
    assert ps.decode(1, code[0], x[0], mu).shape == (mu,)
    assert RingAutoencoder().decode(code[0], mu).shape == (mu,)
    assert sum(p.numel() for p in dec_i.out.parameters()) == 33 + 1  # 32 channels + the innovation channel


def test_autoencoders_learn_a_learnable_signal():
    mu = 64
    base = torch.sin(torch.linspace(0, 6, mu))
    ring = RingAutoencoder(opt="adam", lr=1e-3, seed=1)
    first = ring.train_step(torch.stack([base, 0.9 * base]))
    for _ in range(150):
        last = ring.train_step(torch.stack([base, 0.9 * base]))
    assert last["rec"] < 0.1 * first["rec"]
    ps = PSAutoencoder(2, opt="adam", lr=1e-3, seed=1)
    x = torch.stack([base, -base])
    innov = torch.zeros_like(x)
    innov[:, 10] = x[:, 10]  # the innovation tells the two workers apart
    first = ps.train_step(x, innov)
    for _ in range(150):
        last = ps.train_step(x, innov)
    assert last["rec"] < 0.2 * first["rec"] and last["sim"] >= 0


def test_weights_flatten_roundtrip():
    a, b = RingAutoencoder(seed=1), RingAutoencoder(seed=2)
    assert not torch.equal(flatten_module_state(a), flatten_module_state(b))
    load_module_state(b, flatten_module_state(a))
    assert torch.equal(flatten_module_state(a), flatten_module_state(b))


# -- codec: error feedback, phases, part layouts --------------------------------------------------------------------
def _part_names(parts):
    return [p.name for p in parts]


def test_ps_codec_phases_error_feedback_and_layouts():
    codec = LGCCodec(variant="ps", warmup=2, ae_iters=3, topk=0.01, innovation=0.1)
    codec.setup(worker=0, workers=1)
    plan = codec.set_layers(AWKWARD)
    st = codec.state_for(0, torch.zeros(plan.numel))
    torch.manual_seed(0)
    seen = []
    for step in range(7):
        g = torch.randn(plan.numel)
        acc_before = st.values.get("acc", torch.zeros(plan.numel)).clone()
        if step == 5:
            assert codec.expects_control(st)
            codec.control_in(flatten_module_state(Encoder()), st)
        assert not codec.expects_control(st)
        parts = codec.encode(g, st)
        names = _part_names(parts)
        seen.append(names)
        assert names == codec.layout(codec.config.phase(step), plan, leader=True)
        d = dict(zip(names, (p.data for p in parts)))
        if step >= 2:  # error feedback: what was sent + what stays == old accumulator + gradient (sparse layers)
            sent = torch.zeros(plan.numel)
            sent[decode_indices(d["topk:idx"])] = d["topk:vals"]
            idx_ae = decode_index_list(d["ae:idx"])
            assert idx_ae.numel() == plan.mu("ae") and idx_ae.unique().numel() == idx_ae.numel()
            xs = (acc_before + g)[idx_ae]  # the AE input is ordered by descending value (ae_order=value)
            assert torch.all(xs[:-1] >= xs[1:])
            if step < 5:
                assert torch.equal(d["ae:vals"], xs)
                sent[idx_ae] = d["ae:vals"]
            else:
                assert d["ae:code"].numel() == latent_numel(plan.mu("ae")) and d["ae:scale"].numel() == 1
                x = (acc_before + g)[idx_ae]
                assert torch.allclose(d["ae:scale"], x.pow(2).mean().sqrt())
                pos = decode_indices(d["ae:ipos"])
                assert pos.numel() == math.ceil(0.1 * plan.mu("ae"))
                assert torch.equal(d["ae:ivals"], x[pos])
                sent[idx_ae] = x
            total = sent + st.values["acc"]
            for role in ("topk", "ae"):
                assert torch.allclose(plan.region(total, role), plan.region(acc_before + g, role), atol=1e-6)
            assert plan.region(st.values["acc"], "dense").abs().sum() == 0
    assert "ae:vals" in seen[0] and "ae:idx" not in seen[0]
    assert "ae:idx" in seen[2] and "ae:code" not in seen[4] and "ae:code" in seen[5]
    # a non-leader sends no code
    assert "ae:code" not in codec.layout(Phase.COMPRESSED, plan, leader=False)


def test_momentum_correction_masks_momentum():
    codec = LGCCodec(variant="ps", warmup=0, ae_iters=5, topk=0.01, momentum_correction=True, momentum=0.5)
    codec.setup(worker=0, workers=1)
    plan = codec.set_layers([50, 400, 300])
    st = codec.state_for(0, torch.zeros(plan.numel))
    g1, g2 = torch.randn(plan.numel), torch.randn(plan.numel)
    codec.encode(g1, st)
    u1, acc1 = st.values["mom"].clone(), st.values["acc"].clone()
    parts = codec.encode(g2, st)
    d = dict(zip(_part_names(parts), (p.data for p in parts)))
    u2 = 0.5 * u1 + g2
    v2 = acc1 + u2
    idx = decode_index_list(d["ae:idx"])
    assert torch.allclose(d["ae:vals"], v2[idx])
    assert torch.all(st.values["mom"][idx] == 0) and torch.all(st.values["acc"][idx] == 0)


def test_ps_decode_rejects_wrong_part_count_and_missing_encoder():
    codec = LGCCodec(variant="ps", warmup=0, ae_iters=1, topk=0.01)
    codec.setup(worker=0, workers=1)
    plan = codec.set_layers([30, 3000, 500])
    st = codec.state_for(0, torch.zeros(plan.numel))
    parts = codec.encode(torch.randn(plan.numel), st)
    received = [Received(p.data, torch.ones(1, dtype=torch.bool), 1) for p in parts]
    with pytest.raises(ValueError, match="parts"):
        codec.decode(received[:-1], st, torch.zeros(plan.numel))
    with pytest.raises(RuntimeError, match="encoder"):
        codec.encode(torch.randn(plan.numel), st)


def test_ring_selector_is_shared_and_varies():
    a = LGCCodec(variant="ring", seed=3).setup(worker=0, workers=4)
    b = LGCCodec(variant="ring", seed=3).setup(worker=2, workers=4)
    sa, sb = a.state_for(0, torch.zeros(10)), b.state_for(0, torch.zeros(10))
    seq_a, seq_b = [], []
    for step in range(40):
        sa.step = sb.step = step
        seq_a.append(a.selector(sa))
        seq_b.append(b.selector(sb))
    assert seq_a == seq_b and len(set(seq_a)) == 4


# -- runner: end to end over the in-process comm ----------------------------------------------------------------------
def _run(variant, world, steps, sizes, *, dedicated=False, device="cpu", **opts):
    numel = sum(sizes)

    def body(comm):
        codec = LGCCodec(variant=variant, **opts)
        server = world - 1 if dedicated else 0
        runner = LGCRunner(codec, comm, numel, layers=sizes, device=device, server=server, dedicated_server=dedicated)
        gen = torch.Generator().manual_seed(100 + comm.rank)
        rows = []
        for _ in range(steps):
            g = torch.randn(numel, generator=gen).to(device) if runner.is_worker else None
            acc_before = runner.state.values.get("acc")
            acc_before = acc_before.clone() if acc_before is not None else torch.zeros(numel, device=device)
            out = runner.step(g)
            sent = None
            if g is not None:  # what left this worker's accumulator this round (dense layers: the gradient)
                sent = acc_before + g - runner.state.values.get("acc", torch.zeros(numel, device=device))
            rows.append((g, sent, out))
        return runner, rows

    return run_threads(body, world, timeout=120)


@pytest.mark.parametrize("variant,world,dedicated", [("ps", 3, True), ("ps", 2, False), ("ring", 2, False),
                                                     ("ring", 3, False)])
def test_end_to_end_rounds(variant, world, dedicated):
    steps, warmup, ae_iters = 9, 3, 3
    res = _run(variant, world, steps, AWKWARD, dedicated=dedicated, warmup=warmup, ae_iters=ae_iters, topk=0.01)
    workers = [(r, rows) for r, rows in res if r.is_worker]
    k = len(workers)
    assert k == (world - 1 if dedicated else world)
    plan = workers[0][0].plan
    for t in range(steps):
        outs = [rows[t][2] for _, rows in workers]
        for o in outs[1:]:
            assert torch.equal(o, outs[0])  # every worker applies the same update
        assert torch.isfinite(outs[0]).all()
        mean_g = sum(rows[t][0] for _, rows in workers) / k
        mean_sent = sum(rows[t][1] for _, rows in workers) / k
        phase = LGCConfig(warmup=warmup, ae_iters=ae_iters).phase(t)
        assert torch.allclose(plan.region(outs[0], "dense"), plan.region(mean_g, "dense"), atol=1e-5)
        if phase == Phase.DENSE:
            assert torch.allclose(outs[0], mean_g, atol=1e-5)
        elif phase == Phase.TOPK:  # exactly the mean of what the workers' top-k selections took out
            assert torch.allclose(outs[0], mean_sent, atol=1e-5)
        else:
            assert torch.allclose(plan.region(outs[0], "topk"), plan.region(mean_sent, "topk"), atol=1e-5)
            ae_out, ae_sent = plan.region(outs[0], "ae"), plan.region(mean_sent, "ae")
            assert torch.all(ae_out[ae_sent == 0] == 0)  # the AE layers are only updated where values were selected
            assert ae_out.abs().sum() > 0
    for runner, _ in res:
        assert runner.iters == {"dense": warmup, "topk": ae_iters, "compressed": steps - warmup - ae_iters}
        states = pickle.loads(pickle.dumps(runner.codec.state_dict()))  # checkpointable, AE modules included
        assert states[0].step == runner.state.step and set(states[0].values) == set(runner.state.values)


def _bytes(runners, phase, roles, workers_only=True):
    return sum(r.bytes[phase].get(role, 0) for r in runners if r.is_worker or not workers_only for role in roles)


def test_byte_accounting_per_phase_ring():
    sizes = [640, 20000, 60000, 1290]  # dense / ae / ae / topk
    steps, warmup, ae_iters = 6, 2, 2
    res = _run("ring", 2, steps, sizes, warmup=warmup, ae_iters=ae_iters)
    runners = [r for r, _ in res]
    plan = runners[0].plan
    # dense phase, K = 2: each rank sends exactly the fp32 bytes of every layer once
    for r in runners:
        assert r.bytes["dense"] == {"dense": 640 * 4 * warmup, "ae": 80000 * 4 * warmup, "topk": 1290 * 4 * warmup}
    # compressed phase: each rank sends the latent code once (K = 2) + the selector's index broadcast
    mu = plan.mu("ae")
    code = latent_numel(mu) * 4
    sel_ae = _bytes(runners, "compressed", ["ae", "overhead"]) - 2 * code * (steps - warmup - ae_iters)
    assert 0 < sel_ae < (steps - warmup - ae_iters) * (mu * 4 + 64)  # DEFLATE'd indices + scale + headers
    assert all(r.bytes["compressed"]["dense"] == 640 * 4 * 2 for r in runners)
    # the one-time AE weights go out once, from the trainer, during the last top-k round
    ctl = [r.bytes["topk"].get("ctl", 0) for r in runners]
    assert ctl[0] == sum(p.numel() for p in RingAutoencoder().state_dict().values()) * 4 and ctl[1] == 0
    # the top-k phase all-gathers the aligned AE-layer vectors (1 x mu fp32 per rank to the other rank)
    assert all(r.bytes["topk"]["ae"] >= mu * 4 * ae_iters for r in runners)
    ratio = plan.numel_of("ae") * 4 * 2 * 2 / _bytes(runners, "compressed", ["ae", "overhead"])
    assert ratio > 100


@pytest.mark.parametrize("codes", ["leader", "all"])
def test_byte_accounting_per_phase_ps(codes):
    sizes = [640, 20000, 60000, 1290]
    steps, warmup, ae_iters = 6, 2, 2
    res = _run("ps", 3, steps, sizes, dedicated=True, warmup=warmup, ae_iters=ae_iters, ps_codes=codes)
    runners = [r for r, _ in res]
    workers = [r for r in runners if r.is_worker]
    server = [r for r in runners if not r.is_worker][0]
    plan = workers[0].plan
    # dense phase uplink: each layer role's fp32 bytes + 2-3 header bytes per part, meta + count byte as overhead
    for w in workers:
        b = w.bytes["dense"]
        assert b["dense"] == warmup * (640 * 4 + entry_overhead(640 * 4))
        assert b["ae"] == warmup * (80000 * 4 + entry_overhead(80000 * 4))
        assert b["overhead"] == warmup * (1 + 3 + entry_overhead(3))
        assert "down" not in b
    assert server.bytes["dense"]["down"] > 2 * warmup * plan.numel * 4  # dense mean to both workers
    # compressed phase: the leader sends the code, the other worker does not (ps_codes=all: both send one)
    n_c = steps - warmup - ae_iters
    lead, other = (w.bytes["compressed"]["ae"] for w in sorted(workers, key=lambda w: w.codec.worker))
    code = latent_numel(plan.mu("ae")) * 4
    extra = n_c * (code + entry_overhead(code)) if codes == "leader" else 0
    assert lead - other - extra in range(-8 * n_c, 8 * n_c + 1)  # DEFLATE varies
    shipped = 1 if codes == "leader" else 2  # the encoder goes to every worker that sends a code
    assert server.bytes["topk"]["ctl"] == shipped * sum(p.numel() for p in Encoder().state_dict().values()) * 4
    for w in workers:
        ratio = plan.numel_of("ae") * 4 * n_c / (w.bytes["compressed"]["ae"] + w.bytes["compressed"]["overhead"])
        assert ratio > 100


def test_runner_checks_its_arguments():
    with pytest.raises(ValueError, match="leader"):
        run_threads(lambda c: LGCRunner(LGCCodec(variant="ps", leader=5), c, 10), 2)
    with pytest.raises(ValueError, match="flat gradient"):
        run_threads(lambda c: LGCRunner(LGCCodec(variant="ring"), c, 10).step(torch.zeros(3)), 1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["ps", "ring"])
def test_end_to_end_on_cuda(variant):
    res = _run(variant, 2, 6, AWKWARD, device="cuda", warmup=2, ae_iters=2, topk=0.01, record=True)
    outs = [rows[-1][2] for r, rows in res if r.is_worker]
    assert all(o.is_cuda and torch.isfinite(o).all() for o in outs)
    assert torch.equal(outs[0], outs[1])
    for r, _ in res:  # the diagnostics are kept on the host
        assert all(not t.is_cuda for d in r.state.values.get("diag", []) for t in d.values()
                   if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("variant", ["ps", "ring"])
@pytest.mark.parametrize("order", ["value", "index"])
def test_ablation_zeroes_the_decoded_ae_update(variant, order):
    sizes = [20, 3000, 2000, 300]
    res = _run(variant, 2, 6, sizes, warmup=2, ae_iters=2, topk=0.01, ae_ablate="zero", ae_order=order,
               innovation=0.2)
    plan = res[0][0].plan
    for r, rows in res:
        if not r.is_worker:
            continue
        for _g, _, out in rows[4:]:  # compressed rounds
            region = plan.region(out, "ae")
            nz = int((region != 0).sum())
            if variant == "ring":
                assert nz == 0  # nothing but the (zeroed) decoded output reaches the AE layers
            else:
                assert 0 < nz <= 2 * math.ceil(0.2 * plan.mu("ae"))  # only the exactly-sent innovation values


@pytest.mark.parametrize("variant", ["ps", "ring"])
def test_template_ablation_decodes_the_mean_training_target(variant):
    """ae_ablate=template: the compressed phase's decoded AE output is the running mean of the AE's training targets
    (times the round's scale; PS: with the exact innovation written back), whatever code was sent."""
    sizes = [20, 3000, 2000, 300]
    res = _run(variant, 2, 7, sizes, warmup=2, ae_iters=2, topk=0.01, ae_ablate="template", record=True)
    recs = [d for r, _ in res for d in r.state.values.get("diag", []) if "rec" in d]
    assert len(recs) >= 3  # one per compressed round (ring) or per worker and round (PS)
    for d in recs:
        assert d["rec"].abs().sum() > 0
        assert torch.allclose(d["rec"], d["template"])


def test_ps_codes_all_every_worker_sends_and_decodes_its_own_code():
    sizes = [20, 3000, 2000, 300]
    res = _run("ps", 3, 7, sizes, dedicated=True, warmup=2, ae_iters=2, topk=0.01, ps_codes="all", sim_weight=0.0)
    workers = [(r, rows) for r, rows in res if r.is_worker]
    assert all("encoder" in r.state.values for r, _ in workers)  # the trained encoder reached every worker
    codec = workers[0][0].codec
    plan = workers[0][0].plan
    from dgt.codecs.lgc.plan import Phase
    assert "ae:code" in codec.layout(Phase.COMPRESSED, plan, leader=codec._sends_code(1))
    outs = [rows[-1][2] for _, rows in workers]
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])
    summ = workers[1][0].summary()  # the non-leader now pays for a code too
    assert summ["bytes_sent"]["compressed"]["ae"] > 0
    with pytest.raises(ValueError, match="ps_codes"):
        LGCCodec(variant="ps", ps_codes="some")


def test_ae_replay_trains_on_a_bounded_buffer_of_past_rounds():
    from dgt.codecs.lgc.replay import REPLAY_ROUNDS

    res = _run("ps", 2, 6, [20, 3000, 2000, 300], warmup=1, ae_iters=4, topk=0.01, ae_replay=3)
    server = next(r for r, _ in res if "srv_ae" in r.state.values)
    assert len(server.state.values["srv_replay"]) == 4 <= REPLAY_ROUNDS  # one entry per training round
    assert server.state.values["srv_trained"] == 4
    for bad in ({"ae_replay": -1}, {"ae_loss": "max"}, {"ps_common": "x"}, {"ae_ablate": "ones"}):
        with pytest.raises(ValueError):
            LGCCodec(variant="ps", **bad)


def test_ps_autoencoder_batched_step_matches_the_single_round_step():
    """A (1, K, mu) batch is the same step as the (K, mu) round: the replay path changes nothing without replay."""
    x, innov = torch.randn(2, 57), torch.zeros(2, 57)
    a, b = PSAutoencoder(2, opt="adam", seed=3), PSAutoencoder(2, opt="adam", seed=3)
    la, lb = a.train_step(x, innov), b.train_step(x.unsqueeze(0), innov.unsqueeze(0))
    assert la == lb
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    batch = PSAutoencoder(2, opt="adam", seed=3).train_step(torch.randn(5, 2, 57), torch.zeros(5, 2, 57))
    assert batch["rec"] > 0 and batch["energy"] > 0


@pytest.mark.parametrize("variant,world,dedicated", [("ps", 3, True), ("ps", 2, False), ("ring", 2, False)])
@pytest.mark.parametrize("ablate", ["", "zero", "template"])
def test_ae_error_feedback_applies_exactly_what_left_the_accumulators(variant, world, dedicated, ablate):
    """ae_ef=true: in the compressed phase each worker keeps x - (what the receiver decodes) in its accumulator, so
    the update every worker applies equals the mean of what left the workers' accumulators, in every phase, whatever
    the decoder (PS: the worker decodes its own frame with the shipped decoder exactly as the server does). Without
    ae_ef the AE layers' reconstruction error is lost and the two differ."""
    sizes = [20, 3000, 2000, 300]
    for ef in (True, False):
        res = _run(variant, world, 8, sizes, dedicated=dedicated, warmup=2, ae_iters=3, topk=0.01, ae_ef=ef,
                   ae_ablate=ablate)
        workers = [rows for r, rows in res if r.is_worker]
        plan = next(r for r, _ in res if r.is_worker).plan
        gaps = []
        for t in range(8):
            mean_sent = sum(rows[t][1] for rows in workers) / len(workers)
            gaps.append(float((workers[0][t][2] - mean_sent).abs().max()))
        assert max(gaps[:5]) < 1e-4  # dense and top-k phases: exact either way
        if ef:
            assert max(gaps[5:]) < 1e-4, gaps
            ae_acc = [plan.region(r.state.values["acc"], "ae") for r, _ in res if r.is_worker]
            assert all(a.abs().sum() > 0 for a in ae_acc)  # the error was kept, not zeroed
        else:
            assert min(gaps[5:]) > 1e-3, gaps


def test_ae_error_feedback_needs_every_ps_worker_to_send_its_code():
    with pytest.raises(ValueError, match="ae_ef"):
        LGCCodec(variant="ps", ae_ef=True, ps_codes="leader")
    LGCCodec(variant="ring", ae_ef=True, ps_codes="leader")  # the ring variant has no leader code


def test_ring_replay_trains_the_ring_autoencoder_on_past_rounds():
    res = _run("ring", 2, 7, [20, 3000, 2000, 300], warmup=1, ae_iters=4, topk=0.01, ae_replay=3)
    trainer = next(r for r, _ in res if r.comm.rank == 0)
    assert len(trainer.state.values["srv_replay"]) == 4
    assert "srv_replay" not in next(r for r, _ in res if r.comm.rank == 1).state.values
    x = torch.randn(2, 57)
    a, b = RingAutoencoder("adam", seed=3), RingAutoencoder("adam", seed=3)
    assert a.train_step(x) == b.train_step(x.unsqueeze(0))  # a batch of one round is the same step
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert RingAutoencoder("adam", seed=3).train_step(torch.randn(5, 2, 57))["rec"] > 0
