"""Collectives over the DGT transport: parameter server (gradient all-reduce, or holding the model), ring
all-reduce, gossip; rendezvous via the c10d store."""

from dgt.collectives.blocking import BlockingCollective
from dgt.collectives.direct import DirectAllReduce
from dgt.collectives.gossip import Gossip, ring_matrix
from dgt.collectives.group import Group
from dgt.collectives.model_server import ModelServer, ModelServerStats
from dgt.collectives.ps import ParameterServer
from dgt.collectives.rendezvous import Rendezvous, rendezvous
from dgt.collectives.ring import RingAllReduce
from dgt.collectives.stats import CollectiveResult, CollectiveStats

__all__ = ["BlockingCollective", "CollectiveResult", "CollectiveStats", "DirectAllReduce", "Gossip", "Group",
           "ModelServer", "ModelServerStats", "ParameterServer", "Rendezvous", "RingAllReduce", "rendezvous",
           "ring_matrix"]
