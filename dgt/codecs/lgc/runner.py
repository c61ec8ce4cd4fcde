"""The LGC communication choreography over a :class:`~dgt.codecs.lgc.comm.Comm`, one round per training iteration.

Parameter server (per round):
  1. every worker ``encode``s its bucket and sends one frame to the server (``gather_to``, tag ``<phase>/up``);
  2. the server ``decode``s each worker's frame and ``aggregate``s them (the server trains the PS autoencoder during
     the top-k phase and reconstructs the AE layers in the compressed phase), then broadcasts the mean
     (dense parts dense, sparse parts as DEFLATE-coded union indices + values; tag ``<phase>/down``);
  3. once, after the last top-k round: the server sends the trained encoder to the leader (``send_to``, tag ``ctl``).
Ring all-reduce (per round):
  1. top-k and compressed phases: the round's selector (shared-seed draw) broadcasts its DEFLATE-coded indices (and
     in the compressed phase one scale float) (``broadcast``, tag ``<phase>/sel``);
  2. every rank ``encode``s with those indices; each part is all-reduced (``allreduce_sum``, tag ``<phase>/<role>``)
     except the AE-layer values of the top-k phase, which are all-gathered so the trainer rank can train on them;
  3. every rank ``decode``s the reduced parts (the same latent sum -> the same reconstruction everywhere);
  4. once, after the last top-k round: the trainer broadcasts the AE weights (tag ``ctl``).

Bytes are attributed per phase to the roles ``dense`` / ``topk`` / ``ae`` (the layers they belong to), ``overhead``
(frame headers, the PS meta part), ``down`` (PS downlink) and ``ctl`` (the one-time weights); after every round the
runner checks that what it attributed equals what the Comm counted.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from dgt.codecs.base import Part, Received
from dgt.codecs.lgc.codec import LGCCodec
from dgt.codecs.lgc.comm import Comm, nbytes
from dgt.codecs.lgc.plan import ROLES, Phase
from dgt.codecs.lgc.wire import decode_indices, encode_indices, entry_overhead, pack, unpack

PHASE_NAMES = {Phase.DENSE: "dense", Phase.TOPK: "topk", Phase.COMPRESSED: "compressed"}


def _role(name: str) -> str:
    role = name.split(":")[0]
    return role if role in ROLES else "overhead"


def frame_with_roles(parts: list[Part], device: Any) -> tuple[torch.Tensor, dict[str, int]]:
    """Pack parts into one frame and say how many of its bytes belong to which role."""
    frame = pack([p.data for p in parts], device=device)
    roles: dict[str, int] = defaultdict(int)
    roles["overhead"] += 1  # the part count
    for p in parts:
        roles[_role(p.name)] += p.nbytes + entry_overhead(p.nbytes)
    if sum(roles.values()) != frame.numel():
        raise AssertionError("frame accounting mismatch")
    return frame, roles


def _received(t: torch.Tensor) -> Received:
    return Received(t, torch.ones(1, dtype=torch.bool, device=t.device), max(1, t.numel()))


class LGCRunner:
    """One rank's side of LGC training rounds.

    codec: an :class:`LGCCodec` (one per rank). comm: this rank's Comm. numel: bucket size (the whole model's flat
    gradient, or one bucket). layers/roles: the layer sizes packed in the bucket (see ``LGCCodec.set_layers``).
    PS only: ``server`` is the server's rank; ``dedicated_server`` makes it a non-worker (its ``step`` takes None).
    """

    def __init__(self, codec: LGCCodec, comm: Comm, numel: int, *, layers: list[int] | None = None,
                 roles: list[str] | None = None, device: Any = "cpu", dtype: torch.dtype = torch.float32,
                 bucket_id: int = 0, server: int = 0, dedicated_server: bool = False) -> None:
        self.codec, self.comm = codec, comm
        self.cfg = codec.config
        world = comm.world_size
        if self.cfg.variant == "ps":
            if not 0 <= server < world:
                raise ValueError(f"server rank {server} outside 0..{world - 1}")
            self.server: int | None = server
            self.workers = [r for r in range(world) if not (dedicated_server and r == server)]
        else:
            self.server = None
            self.workers = list(range(world))
        if not self.workers:
            raise ValueError("no worker ranks")
        self.K = len(self.workers)
        self.is_worker = comm.rank in self.workers
        codec.setup(worker=self.workers.index(comm.rank) if self.is_worker else -1, workers=self.K)
        if self.cfg.variant == "ps" and not 0 <= self.cfg.leader < self.K:
            raise ValueError(f"leader {self.cfg.leader} is not a worker index (0..{self.K - 1})")
        if self.cfg.variant == "ring" and not 0 <= self.cfg.trainer < world:
            raise ValueError(f"trainer rank {self.cfg.trainer} outside 0..{world - 1}")
        if layers is not None:
            codec.set_layers(layers, roles, bucket_id)
        self.device = torch.device(device)
        self.like = torch.zeros(numel, dtype=dtype, device=self.device)
        self.state = codec.state_for(bucket_id, self.like)
        self.plan = self.state.values["plan"]
        self.it = 0
        self.bytes: dict[str, dict[str, int]] = {n: defaultdict(int) for n in PHASE_NAMES.values()}
        self.iters: dict[str, int] = {n: 0 for n in PHASE_NAMES.values()}

    # -- one round -------------------------------------------------------------------------------------------------
    def step(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Exchange one round; returns the mean gradient over the workers (None on a dedicated PS server)."""
        if self.is_worker and (grad is None or grad.numel() != self.like.numel()):
            raise ValueError(f"a worker must pass its flat gradient of {self.like.numel()} elements")
        phase = self.cfg.phase(self.it)
        sent0 = self.comm.stats.total_sent
        acct: dict[str, int] = defaultdict(int)
        flat = grad.reshape(-1) if grad is not None else None
        if self.cfg.variant == "ps":
            out = self._ps_round(flat, phase, acct)
        else:
            out = self._ring_round(flat, phase, acct)
        counted = self.comm.stats.total_sent - sent0
        if counted != sum(acct.values()):
            raise AssertionError(f"byte accounting: comm counted {counted}, runner attributed {dict(acct)}")
        pname = PHASE_NAMES[phase]
        for role, b in acct.items():
            self.bytes[pname][role] += b
        self.iters[pname] += 1
        self.it += 1
        if out is None:
            return None
        return out.view_as(grad).to(grad.dtype) if grad is not None else out

    def _ps_round(self, grad: torch.Tensor | None, phase: Phase, acct: dict[str, int]) -> torch.Tensor | None:
        comm, codec, st, dev = self.comm, self.codec, self.state, self.device
        pname, rank, server = PHASE_NAMES[phase], comm.rank, self.server
        assert server is not None
        if self.is_worker:
            frame, roles = frame_with_roles(codec.encode(grad, st), dev)
            if rank != server:
                for role, b in roles.items():
                    acct[role] += b
        else:
            frame = torch.zeros(0, dtype=torch.uint8, device=dev)
        frames = comm.gather_to(server, frame, tag=f"{pname}/up")
        down = None
        if rank == server:
            assert frames is not None
            decoded = [codec.decode([_received(t) for t in unpack(frames[r])], st, self.like) for r in self.workers]
            mean = codec.aggregate(decoded).float() / self.K
            down = pack(self._down_parts(mean, phase), device=dev)
            acct["down"] += nbytes(down) * (comm.world_size - 1)
        got = comm.broadcast(down, server, tag=f"{pname}/down", device=dev)
        mean = self._from_down(unpack(got), phase)
        if rank == server:
            for w, part in codec.control_out(st):
                dst = self.workers[w if w is not None else self.cfg.leader]
                comm.send_to(dst, part.data, tag="ctl")
                if dst != rank:
                    acct["ctl"] += part.nbytes
        if self.is_worker and codec.expects_control(st):
            codec.control_in(comm.recv_from(server, tag="ctl", device=dev), st)
        return mean if self.is_worker else None

    def _down_parts(self, mean: torch.Tensor, phase: Phase) -> list[torch.Tensor]:
        parts = []
        for role in ROLES:
            if not self.plan.layers(role):
                continue
            region = self.plan.region(mean, role)
            if role == "dense" or phase == Phase.DENSE:
                parts.append(region)
            else:
                nz = torch.nonzero(region).reshape(-1)
                parts += [encode_indices(nz), region[nz]]
        return parts

    def _from_down(self, parts: list[torch.Tensor], phase: Phase) -> torch.Tensor:
        out = torch.zeros(self.plan.numel, dtype=torch.float32, device=self.device)
        it = iter(parts)
        for role in ROLES:
            if not self.plan.layers(role):
                continue
            if role == "dense" or phase == Phase.DENSE:
                self.plan.set_region(out, role, next(it).float())
            else:
                nz = decode_indices(next(it), self.device)
                region = torch.zeros(self.plan.numel_of(role), device=self.device)
                region[nz] = next(it).float()
                self.plan.set_region(out, role, region)
        return out

    def _ring_round(self, grad: torch.Tensor, phase: Phase, acct: dict[str, int]) -> torch.Tensor:
        comm, codec, st, dev = self.comm, self.codec, self.state, self.device
        pname, rank, world = PHASE_NAMES[phase], comm.rank, comm.world_size
        if phase != Phase.DENSE:
            sel = codec.selector(st)
            frame = None
            if rank == sel:
                frame, roles = frame_with_roles(codec.select(grad, st), dev)
                for role, b in roles.items():
                    acct[role] += b * (world - 1)
            got = comm.broadcast(frame, sel, tag=f"{pname}/sel", device=dev)
            codec.accept_selection(unpack(got), st, device=dev)
        parts = codec.encode(grad, st)
        received = []
        for part, mode in zip(parts, codec.reduction(parts, st)):
            role = _role(part.name)
            before = comm.stats.total_sent
            if mode == "sum":
                reduced = comm.allreduce_sum(part.data, tag=f"{pname}/{role}")
            else:
                gathered = comm.allgather(part.data, tag=f"{pname}/{role}")
                codec.train_ring(gathered, st, rank)
                reduced = torch.stack(gathered).sum(0)
            acct[role] += comm.stats.total_sent - before
            received.append(_received(reduced))
        mean = codec.decode(received, st, self.like).float() / world
        if codec.expects_control(st):
            trainer = self.cfg.trainer
            data = None
            if rank == trainer:
                (_, part), = codec.control_out(st)
                data = part.data
                acct["ctl"] += part.nbytes * (world - 1)
            codec.control_in(comm.broadcast(data, trainer, tag="ctl", device=dev), st)
        return mean

    # -- reporting -----------------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Bytes this rank sent per phase and role, iterations per phase, and the fp32 size of each role's layers."""
        hist = self.state.values.get("ae_history") or []
        ae_training = None
        if hist:
            # ||rec - x|| / ||x|| on each round's new vectors, measured by the training step before it updates the AE
            # (so on vectors the AE had not seen yet), averaged over the first / last 10 training rounds
            rel = [(h["rec"] / h["energy"]) ** 0.5 if h["energy"] else float("nan") for h in hist]
            n = min(10, len(rel))
            ae_training = {"iterations": len(rel), "rel_error_first": sum(rel[:n]) / n,
                           "rel_error_last": sum(rel[-n:]) / n}
        return {
            "ae_training": ae_training,
            "rank": self.comm.rank,
            "worker": self.codec.worker,
            "iterations": dict(self.iters),
            "bytes_sent": {p: dict(r) for p, r in self.bytes.items()},
            "dense_bytes_per_iteration": {r: self.plan.numel_of(r) * 4 for r in ROLES},
            "mu": {r: self.plan.mu(r) for r in ("topk", "ae")},
        }
