"""Drop-in for PyTorch: a DDP communication hook and a ``torch.distributed`` backend, both over DGT.

One line switches a DDP trainer::

    model.register_comm_hook(dgt.shim.DGTState(), dgt.shim.hook)

and ``import dgt.shim`` makes ``dist.init_process_group(backend="dgt")`` available. See docs/shim.md.
"""

from dgt.collectives.worker import TrioWorker, WorkerClosed
from dgt.shim.backend import DGTBackendOptions, DGTProcessGroup, register_backend
from dgt.shim.hook import hook, submit
from dgt.shim.state import DGTState

register_backend()

__all__ = ["DGTBackendOptions", "DGTProcessGroup", "DGTState", "TrioWorker", "WorkerClosed", "hook",
           "register_backend", "submit"]
