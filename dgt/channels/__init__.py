"""Trio socket channels: reliable TCP lane and its writer (urgent frames first), unreliable UDP lanes (GSO/GRO) and
their datagram scheduler (lane class, pacing, abandoning closed rounds), DSCP marking, stream-lane hops."""
