"""Learned gradient compression (LGC, Abrahamyan et al.): an autoencoder codec for parameter-server and ring
all-reduce training. ``import dgt.codecs.lgc`` registers the ``lgc`` codec; see docs/lgc.md."""

from dgt.codecs.lgc.codec import LGCCodec
from dgt.codecs.lgc.comm import Comm, CommStats
from dgt.codecs.lgc.plan import LayerPlan, LGCConfig, Phase
from dgt.codecs.lgc.runner import LGCRunner

__all__ = [
    "Comm", "CommStats", "LGCCodec", "LGCConfig", "LGCRunner", "LayerPlan", "Phase",
]
