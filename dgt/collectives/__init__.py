"""Collectives over the DGT transport: parameter server, ring all-reduce, gossip; rendezvous via the c10d store."""

from dgt.collectives.gossip import Gossip, ring_matrix
from dgt.collectives.group import Group
from dgt.collectives.ps import ParameterServer
from dgt.collectives.rendezvous import Rendezvous, rendezvous
from dgt.collectives.ring import RingAllReduce
from dgt.collectives.stats import CollectiveResult, CollectiveStats

__all__ = ["CollectiveResult", "CollectiveStats", "Gossip", "Group", "ParameterServer", "Rendezvous",
           "RingAllReduce", "rendezvous", "ring_matrix"]
