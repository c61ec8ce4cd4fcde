"""``dist.init_process_group(backend="dgt")``: a pure-Python c10d process group whose all-reduce rides DGT.

How it fits torch 2.13: a registered creator that returns a ``dist.ProcessGroup`` subclass *becomes* the group.
Such a group has no C++ backend of its own, and DDP's construction (parameter shape check, module state broadcast)
goes through C++ paths that look one up per device type, so the group registers an internal Gloo backend (created
on the same store under its own prefix) for the device types it serves. Python calls and DDP's reducer reach the
``allreduce`` overridden here; every other collective (broadcast, all_gather, barrier, reduce_scatter, ...) goes to
the internal Gloo backend (those the C++ trampoline would call with the GIL held are forwarded explicitly, see
``_TO_GLOO``). Floating-point SUM/AVG all-reduces go over DGT, lossless (dense codec) unless
:class:`DGTBackendOptions` names a lossy codec; other dtypes and ops (MAX, MIN, PRODUCT, ...) go to Gloo.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from dgt.codecs.registry import make_codec
from dgt.collectives.worker import TrioWorker, for_cpp
from dgt.shim.net import checked_transport, group_connector

BACKEND = "dgt"
_DGT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MAX_KEYS = 4096  # distinct tensor shapes tracked for per-shape codec state; more share one key


@dataclass
class DGTBackendOptions:
    """Pass as ``init_process_group("dgt", pg_options=DGTBackendOptions(...))``; environment variables
    ``DGT_BACKEND_CODEC``, ``DGT_BACKEND_COLLECTIVE``, ``DGT_BACKEND_LOSSY_MIN_NUMEL`` set the defaults, so a
    torchrun script can switch without code changes.

    codec: codec of the DGT all-reduce (``"dense"``: lossless; ``"dgt:p=0.3"`` etc.: lossy where allowed).
    collective: ``"ring"`` or ``"ps"`` (parameter server on rank 0).
    lossy_min_numel: a lossy codec applies only to tensors of at least this many elements; smaller all-reduces
        (losses, metrics, counters) stay lossless.
    transport: a ``TransportConfig`` or a dict of its fields. host: the address to advertise (default: route to
        MASTER_ADDR, or DGT_HOST).
    """

    codec: str = ""
    collective: str = ""
    lossy_min_numel: int = -1
    transport: Any = None
    host: str | None = None

    def __post_init__(self) -> None:
        self.codec = self.codec or os.environ.get("DGT_BACKEND_CODEC", "dense")
        self.collective = self.collective or os.environ.get("DGT_BACKEND_COLLECTIVE", "ring")
        if self.lossy_min_numel < 0:
            self.lossy_min_numel = int(os.environ.get("DGT_BACKEND_LOSSY_MIN_NUMEL", "65536"))
        if self.collective not in ("ring", "ps"):
            raise ValueError("collective must be 'ring' or 'ps'")
        make_codec(self.codec)  # an unknown codec or option: the ValueError here, not in the first collective
        checked_transport(self.transport)


class DGTProcessGroup(dist.ProcessGroup):
    """The process group ``init_process_group(backend="dgt")`` creates (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 options: DGTBackendOptions | None = None) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        # not `options`: torch 2.1's ProcessGroup has a read-only property of that name
        self.dgt_options = options or DGTBackendOptions()
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        for dev in ("cpu", "cuda"):
            if dev == "cpu" or torch.cuda.is_available():
                self._register_backend(torch.device(dev), dist.ProcessGroup.BackendType.GLOO, self.gloo)
        if hasattr(self, "_set_default_backend"):  # torch 2.4 has no such call: its backend per device is enough
            self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        opts = self.dgt_options
        connect = group_connector(rank, size, store=store, config=opts.transport, host=opts.host,
                                  timeout=timeout.total_seconds(), prefix="dgt")
        self.worker = TrioWorker(connect, name=f"dgt-backend-r{rank}")
        self._lossless = make_codec("dense")
        self._lossy = make_codec(self.dgt_options.codec)
        self._colls: dict[tuple[bool, str], Any] = {}
        self._keys: dict[tuple, int] = {}
        self._next_key = itertools.count()
        self.stats: dict[str, Any] = {"dgt": 0, "gloo": 0, "lossy": 0, "dropped": 0, "seconds": 0.0}

    # -- collectives --------------------------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor] | torch.Tensor,
                  opts: dist.AllreduceOptions | None = None) -> dist.Work:
        """SUM/AVG of floating-point tensors over DGT; anything else over the internal Gloo group."""
        if opts is None:
            opts = dist.AllreduceOptions()
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        op = opts.reduceOp
        mean = op == dist.ReduceOp.AVG
        if not (mean or op == dist.ReduceOp.SUM) or not all(_dgt_carries(t) for t in tensors):
            self.stats["gloo"] += 1
            return self.gloo.allreduce(tensors, opts)
        self.stats["dgt"] += 1
        devices = sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)
        ready = None
        if devices:
            ready = {d: torch.cuda.Event() for d in devices}
            for d, ev in ready.items():
                ev.record(torch.cuda.current_stream(d))
        plan = [(t, self._key(t), self._codec_for(t)) for t in tensors]

        async def job(group: Any) -> list[torch.Tensor]:
            if devices:
                torch.cuda.set_device(devices[0])
            for d, ev in (ready or {}).items():
                torch.cuda.current_stream(d).wait_event(ev)
            for t, key, lossy in plan:
                coll = self._collective(group, lossy, "mean" if mean else "sum")
                t0 = time.perf_counter()
                res = await coll.allreduce(t.detach().reshape(-1), key, None)
                self.stats["seconds"] += time.perf_counter() - t0
                self.stats["dropped"] += res.stats.dropped
                self.stats["lossy"] += int(lossy)
                t.detach().copy_(res.tensor.view_as(t))
            return list(tensors)

        return _create_work_from_future(for_cpp(self.worker.submit(job, devices)))

    def _codec_for(self, t: torch.Tensor) -> bool:
        return self._lossy.name != "dense" and t.numel() >= self.dgt_options.lossy_min_numel

    def _key(self, t: torch.Tensor) -> int:
        """A bucket id per tensor shape and dtype (first-seen order, identical on every rank), so a lossy codec's
        per-bucket state (DGT's moving scores) follows each gradient bucket across steps."""
        sig = (t.numel(), t.dtype)
        if sig not in self._keys:
            self._keys[sig] = next(self._next_key) if len(self._keys) < _MAX_KEYS else _MAX_KEYS
        return self._keys[sig]

    def _collective(self, group: Any, lossy: bool, op: str) -> Any:
        from dgt.collectives import ParameterServer, RingAllReduce

        key = (lossy, op)
        if key not in self._colls:
            codec = self._lossy if lossy else self._lossless
            if self.dgt_options.collective == "ring":
                self._colls[key] = RingAllReduce(group, codec, op=op)
            else:
                self._colls[key] = ParameterServer(group, codec, op=op, server=0)
        return self._colls[key]

    # -- life cycle ---------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Called by ``destroy_process_group``: stop the DGT worker, then the Gloo backend."""
        self.worker.close()
        try:
            super().shutdown()
        except RuntimeError:  # backends without shutdown support
            pass

    def getBackendName(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"DGTProcessGroup(rank={self._rank}, size={self._size}, codec={self.dgt_options.codec!r})"


# Collectives a Python ProcessGroup subclass inherits from C++ (torch's PyProcessGroup trampoline, WORK_OVERRIDE).
# For one not overridden in Python, the trampoline calls the base class *while still holding the GIL*, and the base
# class enqueues on Gloo under Gloo's work mutex. Gloo's worker thread meanwhile frees the work it just finished
# under that same mutex, and freeing a work's tensors takes the GIL: a deadlock, seen as both ranks of the shim test
# stuck in dist.broadcast after a Gloo all-reduce (rank 1's main thread in ProcessGroupGloo::enqueue, its Gloo
# worker in ~AsyncWork waiting for the GIL). Overriding them in Python and calling the Gloo backend's own binding,
# which releases the GIL, breaks the cycle.
_TO_GLOO = ("allgather", "allreduce_coalesced", "barrier", "broadcast", "reduce_scatter", "send", "recv")


def _via_gloo(name: str):
    def forward(self: DGTProcessGroup, *args: Any, **kwargs: Any) -> dist.Work:
        if name == "allreduce_coalesced":  # an all-reduce, counted like those sent to Gloo by allreduce
            self.stats["gloo"] += 1
        return getattr(self.gloo, name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"``{name}`` on the internal Gloo backend, called so that it runs without the GIL."
    return forward


for _name in _TO_GLOO:
    setattr(DGTProcessGroup, _name, _via_gloo(_name))


def _dgt_carries(t: torch.Tensor) -> bool:
    return t.dtype in _DGT_DTYPES and t.device.type in ("cpu", "cuda") and not t.is_sparse


def _create(dist_opts: Any, backend_options: Any = None) -> DGTProcessGroup:
    """The creator registered with c10d (extended API: gets ``_DistributedBackendOptions`` and ``pg_options``)."""
    if backend_options is not None and not isinstance(backend_options, DGTBackendOptions):
        raise TypeError(f"pg_options for the dgt backend must be DGTBackendOptions, not {type(backend_options)}")
    timeout = dist_opts.timeout if isinstance(dist_opts.timeout, timedelta) else timedelta(seconds=60)
    return DGTProcessGroup(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, timeout, backend_options)


def register_backend() -> None:
    """Make ``backend="dgt"`` known to torch.distributed (idempotent; ``import dgt.shim`` does it)."""
    if BACKEND.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
