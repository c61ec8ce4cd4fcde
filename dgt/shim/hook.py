"""The DDP communication hook: ``model.register_comm_hook(DGTState(), hook)``.

DDP calls the hook on its autograd thread, once per gradient bucket, in bucket order, on every rank. The hook only
records the bucket's identity and hands it to the state's trio worker; the worker runs the collective (dense during
the warm-up, then the configured codec) and completes the returned future with the averaged bucket. DDP does not
divide by the world size before a hook, so the collectives compute the mean.

(No ``from __future__ import annotations`` here: DDP's ``register_comm_hook`` compares the hook's annotations with
``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects.)
"""

import time
from typing import Any

import torch
import torch.distributed as dist

from dgt.collectives.worker import for_cpp
from dgt.shim.chooser import LOSSY_MODES, LOWRANK
from dgt.shim.state import LOWRANK_BUCKETS, DGTState


def hook(state: DGTState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the ranks through DGT; returns at once with a future completed by the worker."""
    buf = bucket.buffer()
    index = bucket.index()
    grads = bucket.gradients()
    segments = [g.numel() for g in grads]
    # the low-rank codec reads every gradient of >= 2 dimensions as a matrix (shape[0] x the rest): it needs shapes
    shapes = [tuple(g.shape) for g in grads] if state.needs_shapes else None
    clear = state.note_bucket(index, buf.numel(), buf.dtype, segments)
    use_codec = state.past_warmup
    it, last = state.iter, bucket.is_last()
    if last:
        state.iter += 1
    return submit(state, buf, index, segments, shapes=shapes, use_codec=use_codec, clear=clear, it=it, last=last)


def submit(state: DGTState, buf: torch.Tensor, index: int, segments: list[int] | None = None, *,
           shapes: list[tuple[int, ...]] | None = None, use_codec: bool = True, clear: bool = False,
           it: int | None = None, last: bool = True) -> torch.futures.Future[torch.Tensor]:
    """Queue the mean all-reduce of ``buf`` (a flat tensor) on the state's worker (also usable without DDP):
    with the state's codec, or densely and losslessly when ``use_codec`` is False; ``clear`` drops the codec's
    per-bucket state first. ``it``/``last``: the training iteration and whether ``buf`` is its last bucket; with
    them the state's chooser (if any) picks the lossless, the lossy (or the low-rank) path and times the round.
    ``shapes``: the shapes of the tensors packed in ``buf``, in order, for the low-rank codec (which compresses
    those with two or more dimensions; None: ``buf`` is one 1-D tensor, sent dense); the other codecs take
    ``segments``."""
    devices = None
    ready = None
    if buf.device.type == "cuda":
        # the gradients were written on the autograd thread's stream: the worker's stream waits for them on the GPU
        devices = [buf.device]
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(buf.device))

    async def job(group: Any) -> torch.Tensor:
        if ready is not None:
            torch.cuda.set_device(buf.device)
            torch.cuda.current_stream(buf.device).wait_event(ready)
        if clear:  # DDP rebuilt its buckets: the codec's per-bucket state describes tensors that no longer exist
            state.clear_codecs()
        coll, mode = state.pick(group, use_codec, it)
        if it == 0:  # DDP's first iteration (never timed by the chooser): the connections its paths will need
            await state.open_paths(group)
        lossy = mode in LOSSY_MODES
        t0 = time.perf_counter()
        if mode == LOWRANK:  # the chooser's low-rank path: native dtype, mean, bucket ids apart from the rings'
            res = await coll.allreduce(buf, LOWRANK_BUCKETS + index, shapes)
        elif lossy and state.low_rank:
            res = await coll.allreduce(buf, index, shapes)
        elif lossy:
            state.warm_p(it)
            res = await coll.allreduce(state.lossy_input(buf, group.world), index, segments)
        else:
            res = await coll.allreduce(buf, index, segments)
        seconds = time.perf_counter() - t0
        state.record(index, res.stats, use_codec, seconds, lossy, mode)
        if it is not None and state.chooser is not None:
            if use_codec:
                await state.after_round(group, it, last, seconds)
            else:  # the dense warm-up: its last iteration is the lossless path's first figure
                state.chooser.observe(it, seconds, last)
        return res.tensor.to(buf.dtype).view_as(buf)

    return for_cpp(state.worker.submit(job, devices))
