"""Exception types every dgt layer raises; one root so callers can catch all of dgt."""

from __future__ import annotations


class DgtError(Exception):
    """Root of all dgt errors."""


class WireError(DgtError):
    """Bytes that are not a valid DGT frame (bad magic/version/type, lengths beyond limits, truncation)."""


class ProtocolError(DgtError):
    """A well-formed frame that makes no sense in the current state (unknown round, layout mismatch)."""


class PeerTimeout(DgtError):
    """A peer stopped answering: raised within the configured timeout instead of hanging."""


class PeerClosed(DgtError):
    """A peer closed its connection while an operation was pending."""


class RendezvousTimeout(DgtError):
    """A rank never showed up at the rendezvous store within the timeout."""


class CodecMismatch(DgtError):
    """A codec was paired with a collective it cannot serve."""


class EmulationUnsupported(DgtError):
    """A requested network emulation property needs a kernel feature this machine lacks."""
