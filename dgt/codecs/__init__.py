"""Pluggable payload codecs (dense, DGT, Slim-DP, QSGD, Oland-Raj, LGC) behind one interface."""

from dgt.codecs.base import DROPPABLE, RELIABLE, BucketState, Capabilities, Codec, Part, Received
from dgt.codecs.registry import available, make_codec, parse_spec, register

__all__ = [
    "BucketState", "Capabilities", "Codec", "DROPPABLE", "Part", "RELIABLE", "Received",
    "available", "make_codec", "parse_spec", "register",
]
