"""Trio socket channels: reliable TCP lane, unreliable UDP lanes (GSO/GRO), DSCP marking, pacing."""
