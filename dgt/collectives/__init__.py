"""Collectives over the DGT transport: parameter server, ring all-reduce, gossip."""
