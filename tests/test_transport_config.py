"""TransportConfig in groups (issue 44): each group checked when it is made, the flat keywords of before mapped onto the
groups with a DeprecationWarning naming the new spelling, and no second block size beside the codec's."""

from __future__ import annotations

import dataclasses
import pickle
import warnings

import pytest

from dgt import wire
from dgt.transport import (
    Congestion,
    Faults,
    Hops,
    Lanes,
    Limits,
    Pacing,
    Security,
    Sockets,
    Timeouts,
    TransportConfig,
    three_lanes,
)
from dgt.transport.config import GROUPS, LEGACY


def test_the_groups_are_frozen_dataclasses_with_the_old_defaults() -> None:
    cfg = TransportConfig()
    assert cfg.timeouts.peer == 10.0 and cfg.timeouts.round == 600.0 and cfg.timeouts.connect is None
    assert cfg.pacing == Pacing(rate=None, shared=False, burst=256 << 10)
    assert cfg.congestion.enabled and cfg.congestion.cpu_gate == 0.1 and cfg.congestion.start_rate == 12.5e6
    assert cfg.security.datagram_mac and cfg.security.check_source and cfg.security.max_pending_handshakes == 64
    assert cfg.sockets.udp_rcvbuf == 32 << 20 and cfg.hops == Hops("auto", 0) and cfg.faults == Faults(0.0, None)
    assert cfg.limits is wire.DEFAULT_LIMITS and Limits is wire.Limits  # wire.Limits is the group itself
    assert [ln.kind for ln in cfg.lanes.specs] == ["tcp", "udp"] and cfg.unreliable_lanes == 1
    for name, cls in GROUPS.items():
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, name  # type: ignore[attr-defined]
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(getattr(cfg, name), dataclasses.fields(cls)[0].name, None)


@pytest.mark.parametrize("make,match", [
    (lambda: Pacing(shared=True), "Pacing.shared needs Pacing.rate"),
    (lambda: Pacing(rate=0), "Pacing.rate must be positive"),
    (lambda: Congestion(cpu_gate=1.5), r"Congestion.cpu_gate must be in \[0, 1\]"),
    (lambda: Congestion(min_rate=10.0, max_rate=1.0), "min_rate <= max_rate"),
    (lambda: Timeouts(peer=0), "Timeouts.peer and Timeouts.round must be positive"),
    (lambda: Timeouts(connect=-1), "Timeouts.connect must be positive"),
    (lambda: Faults(drop_fraction=2.0), r"Faults.drop_fraction must be in \[0, 1\]"),
    (lambda: Hops(mode="fast"), "Hops.mode must be auto, native, python or off"),
    (lambda: Hops(threads=3), "Hops.threads must be 0"),
    (lambda: Lanes(datagram_payload=8), r"Lanes.datagram_payload must be in \[16, 65000\]"),
    (lambda: Lanes(specs=["tcp:EF"]), "at least one unreliable lane"),
    (lambda: Security(max_pending_handshakes=0), "Security.max_pending_handshakes must be at least 1"),
    (lambda: Sockets(gso_segments=0), "Sockets.gso_segments must be at least 1"),
    (lambda: TransportConfig(deadline="soon"), "unknown deadline policy"),
    (lambda: TransportConfig(max_buffered_results=0), "max_buffered_results must be at least 1"),
])
def test_a_bad_value_fails_when_its_group_is_made_naming_the_field(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_every_flat_keyword_of_before_still_works_with_a_warning_naming_the_new_spelling() -> None:
    values = {"datagram_payload": 1000, "port_range": None, "pace_rate": 5e6, "pace_shared": True, "pace_burst": 4096,
              "congestion_control": False, "cc_target": 0.02, "pace_start": 1e6, "pace_min": 1e3, "pace_max": 1e8,
              "cpu_gate": 0.0, "secret": "s", "datagram_mac": False, "check_source": False,
              "max_pending_handshakes": 8, "peer_timeout": 3.0, "connect_timeout": 2.0, "heartbeat": 0.5,
              "round_timeout": 30.0, "gso": False, "gro": False, "gso_segments": 8, "udp_rcvbuf": 1 << 20,
              "udp_sndbuf": 1 << 20, "tcp_rcvbuf": 1 << 20, "tcp_sndbuf": 1 << 20, "udp_batch_bytes": 1 << 20,
              "reliable_frame_bytes": 1 << 16, "stream_hops": "off", "hop_threads": 1, "drop_fraction": 0.25,
              "drop_seed": 3}
    assert set(values) == set(LEGACY)
    for old, value in values.items():
        group, name = LEGACY[old]
        extra = {"pace_rate": 1e6} if old == "pace_shared" else {}
        with pytest.warns(DeprecationWarning) as caught:
            cfg = TransportConfig(**{old: value}, **extra)
        cls = GROUPS[group].__name__
        assert any(f"TransportConfig({group}={cls}({name}=...))" in str(w.message) for w in caught), old
        assert getattr(getattr(cfg, group), name) == value, old
    with pytest.warns(DeprecationWarning, match=r"Lanes\(specs="):
        cfg = TransportConfig(lanes=three_lanes())
    assert cfg.lanes == Lanes(specs=three_lanes())


def test_flat_keywords_merge_into_a_group_given_beside_them_and_old_reads_and_writes_map_too() -> None:
    with pytest.warns(DeprecationWarning):
        cfg = TransportConfig(pacing=Pacing(burst=1234), pace_rate=2e6, timeouts={"round": 9.0}, peer_timeout=4.0)
    assert cfg.pacing == Pacing(rate=2e6, burst=1234) and cfg.timeouts == Timeouts(peer=4.0, round=9.0)
    with pytest.warns(DeprecationWarning, match=r"cfg\.timeouts\.peer"):
        assert cfg.peer_timeout == 4.0  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match="set cfg.faults"):
        cfg.drop_fraction = 0.5  # type: ignore[attr-defined]
    assert cfg.faults.drop_fraction == 0.5
    with pytest.raises(AttributeError, match="no field 'pace_ratee'"):
        cfg.pace_ratee = 1.0  # type: ignore[attr-defined]  # a typo is not silently a new attribute
    with pytest.raises(AttributeError):
        _ = cfg.no_such_setting  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match=r"cfg\.lanes\.specs"):
        assert len(cfg.lanes) == 2 and cfg.lanes[0].kind == "tcp"  # type: ignore[arg-type,index]
    with pytest.warns(DeprecationWarning, match=r"cfg\.lanes\.specs"):
        assert [ln.kind for ln in cfg.lanes] == ["tcp", "udp"]  # type: ignore[attr-defined]


def test_the_new_spelling_raises_no_warning_and_round_trips_through_to_dict() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = TransportConfig(lanes=Lanes(specs=three_lanes(), datagram_payload=1200), pacing=Pacing(rate=1e8),
                              timeouts=Timeouts(peer=5), security=Security(secret=b"k"), deadline="fixed:0.05",
                              faults={"drop_fraction": 0.1, "drop_seed": 1})
        d = cfg.to_dict()
        back = TransportConfig(**d)
    assert "secret" not in d["security"] and back.security.secret is None
    assert back == dataclasses.replace(cfg, security=Security())
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    with pytest.raises(TypeError, match="expected a Pacing"):
        TransportConfig(pacing=5)  # type: ignore[arg-type]


def test_the_block_size_has_one_source_a_conflicting_transport_block_is_refused() -> None:
    """The transport has no block setting: the codec's (the layout's) is the only one. The old keyword at its old
    default warns and does nothing; another value fails at once saying where the block size is set now."""
    with pytest.raises(TypeError, match="no block size.*codec"):
        TransportConfig(block=256)
    with pytest.warns(DeprecationWarning, match="no effect"):
        cfg = TransportConfig(block=1024)
    with pytest.raises(AttributeError, match="codec"):
        _ = cfg.block  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="codec"):
        cfg.block = 512  # type: ignore[attr-defined]
    assert "block" not in cfg.to_dict()


SEGMENTS = [3000, 5, 20000, 1500]


def _ring_rank(rank: int, world: int, codec: str) -> tuple:
    import torch
    import trio

    from dgt.collectives import Group, RingAllReduce

    async def main() -> tuple:
        async with Group.open(rank, world, config=TransportConfig(timeouts=Timeouts(peer=30)), timeout=30) as g:
            x = torch.randn(sum(SEGMENTS), generator=torch.Generator().manual_seed(rank))
            res = await RingAllReduce(g, codec).allreduce(x, 0, SEGMENTS)
            return res.tensor, res.stats.blocks

    return trio.run(main)  # type: ignore[no-any-return]


@pytest.mark.parametrize("codec", ["dgt:p=1.0,block=512", "dgt:p=0.5,block=512"])
def test_a_codec_block_other_than_1024_is_the_block_the_ring_sends_in(codec: str) -> None:
    """Before issue 44 the lossy ring cut the transport's 1024-element blocks and refused a DGT codec of another
    block (per-block lane classes name the codec's blocks): two block sizes that could disagree. Now the codec's is
    the one the hop travels in."""
    import torch

    from dgt.collectives.launch import run_ranks

    outs = run_ranks(_ring_rank, 2, codec, timeout=120)
    (a, blocks_a), (b, _blocks_b) = outs[0], outs[1]
    assert torch.equal(a, b) and bool(torch.isfinite(a).all())
    mean = sum(torch.randn(sum(SEGMENTS), generator=torch.Generator().manual_seed(r)) for r in range(2)) / 2
    if codec.startswith("dgt:p=1.0"):  # every block important: lossless
        assert torch.allclose(a, mean, atol=1e-6)
    # the blocks counted are 512-element ones: more than the same bucket has in 1024-element blocks
    assert blocks_a > sum((n + 1023) // 1024 for n in SEGMENTS)
