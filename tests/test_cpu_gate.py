"""The CPU gate of lossy ring hops (dgt.protocol.cpu_gate), sans-IO: readings in, open or closed out."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dgt.protocol.cpu_gate import CpuGate
from dgt.transport import Congestion, TransportConfig


def test_the_gate_closes_above_its_threshold_and_reopens_under_half_of_it():
    g = CpuGate(threshold=0.1, alpha=1.0, warm=1)  # no averaging: each reading is the value
    assert g.admit() and g.value is None
    g.observe(0.0005, 0.01)  # 5 % of the transfer waiting for a CPU: there is CPU to spare
    assert g.admit() and g.value == pytest.approx(0.05)
    g.observe(0.0025, 0.01)  # 25 %: closed
    assert g.closed and not g.admit() and g.closes == 1
    g.observe(0.0007, 0.01)  # 7 %: under the threshold but not under half of it: still closed (hysteresis)
    assert not g.admit()
    g.observe(0.0004, 0.01)  # 4 %: open again
    assert g.admit() and g.closes == 1
    assert g.gated == 2 and g.readings == 4  # the rounds it kept back, the readings it took


def test_the_average_needs_several_busy_transfers_to_close():
    g = CpuGate(threshold=0.1, alpha=0.25, warm=1)
    g.observe(0.0, 0.01)
    while not g.closed and g.readings < 10:
        g.observe(0.003, 0.01)  # 30 % each: the EWMA crosses 10 % on the second
    assert g.readings == 3 and g.value == pytest.approx(0.25 * 0.3 + 0.75 * 0.25 * 0.3)


def test_the_first_transfers_never_close_it():
    g = CpuGate(threshold=0.1, alpha=1.0)  # warm = 3 by default
    g.observe(0.009, 0.01)
    g.observe(0.009, 0.01)
    assert g.value == pytest.approx(0.9) and g.admit()  # a link's start-up, not yet the host
    g.observe(0.009, 0.01)
    assert not g.admit() and g.closes == 1


def test_unknown_or_too_short_readings_change_nothing():
    g = CpuGate(threshold=0.1, min_span=0.001)
    for queued, span in [(None, 0.01), (0.5, 0.0005), (math.nan, 0.01), (0.001, math.inf)]:
        g.observe(queued, span)
    assert g.value is None and g.readings == 0 and g.admit()


def test_a_reading_is_a_fraction_of_the_transfer():
    g = CpuGate(alpha=1.0)
    g.observe(5.0, 0.01)  # more wait than span (clock skew between the two reads): counts as all of it
    assert g.value == 1.0
    g.observe(-0.001, 0.01)  # a counter that went back (not the same thread): counts as none
    assert g.value == 0.0


@pytest.mark.parametrize("kw", [{"threshold": 0.0}, {"threshold": 1.5}, {"alpha": 0.0}, {"reopen": -0.1}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        CpuGate(**kw)


@given(st.lists(st.tuples(st.floats(0, 0.02), st.floats(0.0002, 0.02)), max_size=60),
       st.floats(0.01, 1.0), st.floats(0.05, 1.0), st.floats(0.0, 1.0), st.integers(0, 5))
def test_open_or_closed_always_agrees_with_the_average(readings, threshold, alpha, reopen, warm):
    g = CpuGate(threshold=threshold, alpha=alpha, reopen=reopen, warm=warm)
    for queued, span in readings:
        g.observe(queued, span)
        assert 0.0 <= g.value <= 1.0
        if g.closed:  # closed only above the threshold, and stays closed until under threshold * reopen
            assert g.value >= threshold * reopen and g.readings >= warm
        else:
            assert g.value <= threshold or g.readings < warm


def test_the_transport_setting():
    assert TransportConfig().congestion.cpu_gate == 0.1
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="cpu_gate"):
            TransportConfig(congestion=Congestion(cpu_gate=bad))
