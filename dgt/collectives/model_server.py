"""A parameter server that holds the model (the Slim-DP setting, Sun et al. 2018) over the DGT transport.

Why a second parameter server: :class:`~dgt.collectives.ps.ParameterServer` all-reduces gradients (the server hands
back the aggregate and keeps nothing). Slim-DP needs a server that *owns* the model ``w``: every round each worker
pushes its delta, the server applies ``w <- w - lr * sum_k decode(push_k)`` (a sum, not a mean) and answers every
worker with an encoding of the fresh ``w`` that the worker merges into its own replica (Slim-DP: pulled coordinates
overwrite, the rest keep the local values; dense: the whole model is replaced).

Codec state lives where the paper puts it: the server keeps one receive state per worker (each worker has its own
cached core) and one send state for the pull (one encoding of ``w``, the same parts to every worker); every worker
keeps a send state for its pushes and a receive state for the pulls. Parts ride the lanes their ``lane_class``
names (Slim-DP: header, core and core keys on lane 0 = TCP, the explorer on lane 1 = UDP). A receiver reads a
message's header part first when the codec can describe the rest from it (``wire_parts``: Slim-DP refresh rounds
carry one more part); other codecs have a fixed part geometry, taken once from an encoding of zeros.

Codecs whose parts need not be cut in the transport's block size (Slim-DP's 6-int header) are re-blocked for the
transport; the transport's per-block received mask is mapped back to the codec's blocks (a codec block counts as
received only if all of its elements arrived).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from dgt.codecs.base import BucketState, Codec, Part, Received
from dgt.codecs.bucketinfo import set_segments
from dgt.codecs.registry import make_codec, parse_spec
from dgt.collectives.base import Collective, _refuse, plain_input, tells_peers
from dgt.collectives.group import Group
from dgt.collectives.parts import as_received, check_op, decode_parts, send_parts, transport_key
from dgt.collectives.stats import CollectiveResult, CollectiveStats
from dgt.errors import DgtError, InputRejected, RankMismatch, call_code, one_error, open_nursery, shape_mismatch
from dgt.wire import HEADER_SIZE


@dataclass
class ModelServerStats(CollectiveStats):
    """CollectiveStats plus what a byte and loss audit needs: frames per lane (each adds a ``HEADER_SIZE`` transport
    header to ``bytes_received``), and per part name the codec blocks lost and their elements."""

    frames_received: dict[int, int] = field(default_factory=dict)
    lost_blocks: dict[str, int] = field(default_factory=dict)
    lost_elems: dict[str, int] = field(default_factory=dict)

    def add_round(self, stats) -> None:
        super().add_round(stats)
        for lane, ls in stats.lanes.items():
            self.frames_received[lane] = self.frames_received.get(lane, 0) + ls.frames

    def payload_received(self, lane: int) -> int:
        """Bytes of payload that arrived on ``lane`` (transport frame headers taken off)."""
        return self.bytes_received.get(lane, 0) - HEADER_SIZE * self.frames_received.get(lane, 0)

    def merge(self, other: CollectiveStats) -> None:
        super().merge(other)
        if isinstance(other, ModelServerStats):
            for lane, n in other.frames_received.items():
                self.frames_received[lane] = self.frames_received.get(lane, 0) + n
            for name, n in other.lost_blocks.items():
                self.lost_blocks[name] = self.lost_blocks.get(name, 0) + n
            for name, n in other.lost_elems.items():
                self.lost_elems[name] = self.lost_elems.get(name, 0) + n


def build_codec(spec: str | Codec, **extra: object) -> Codec:
    """A codec from a registry spec with ``extra`` options added where the spec does not set them and the codec
    takes them (``rank`` for independent random draws per rank, ``mode=pull``); instances pass through."""
    if isinstance(spec, Codec):
        return spec
    name, given = parse_spec(spec)
    accepted = inspect.signature(type(make_codec(name)).__init__).parameters
    opts = {**{k: v for k, v in extra.items() if k in accepted}, **given}
    return make_codec(f"{name}:" + ",".join(f"{k}={v}" for k, v in opts.items()) if opts else name)


class ModelServer(Collective):
    """Workers push deltas, the server updates the model it holds, workers pull and merge (one call per round).

    ``codec``: the push codec (spec or instance); built per rank with ``rank=<rank>``. ``pull``: the pull codec;
    None = the push spec with ``mode=pull`` when that codec merges (Slim-DP), else ``"dense"``; built with
    ``mode=pull, rank=<world>`` (a stream distinct from every worker's). ``model``: the initial model, the same on
    every rank (the server keeps a copy; everyone takes numel, dtype and device from it). ``lr``: the server's step.
    ``server_trains``: the server rank is also a worker (its own push never crosses the network).

    Every rank must make it with the same model size and dtype and the same push codec: a rank that differs raises
    the same :class:`~dgt.errors.RankMismatch` as every other rank, from the first message (the push codec rides in
    every frame's call code, part sizes and dtypes are compared on arrival). ``delta`` and ``local`` of any layout;
    one that is not a dense tensor of the model's size and dtype is refused with
    :class:`~dgt.errors.InputRejected` before any traffic, and the call's peers are told (docs/collectives.md).
    """

    name = "model server"
    serves_stateful_server = True

    def __init__(self, group: Group, codec: str | Codec = "dense", pull: str | Codec | None = None, *,
                 model: torch.Tensor, lr: float, server: int = 0, server_trains: bool = True,
                 segments: list[int] | None = None, bucket_id: int = 0, every: int = 1,
                 average: bool = False) -> None:
        super().__init__(group, codec, op="sum")
        if not 0 <= server < group.world:
            raise ValueError("server must be a rank")
        if int(every) != every or every < 1:
            raise ValueError(f"every (the communication frequency p) must be an integer >= 1, not {every!r}")
        self.every = int(every)  # Slim-DP's p: push/pull on every p-th step, deltas accumulated in between
        self._calls = 0
        self._pending: torch.Tensor | None = None
        # model averaging (Oland & Raj): workers push their parameters, the server's w becomes their mean
        self.average = bool(average)
        self.server = server
        self.server_trains = server_trains
        self.lr = float(lr)
        self.bucket_id = bucket_id
        flat = model.detach().reshape(-1)
        self.numel, self.dtype, self.device = flat.numel(), flat.dtype, flat.device
        self.segments = list(segments) if segments else [self.numel]
        self.workers = [r for r in range(group.world) if r != server or server_trains]
        if pull is None:
            if isinstance(codec, Codec) and codec.capabilities.merges:
                raise ValueError("pass the pull codec (built with mode=pull) when the push codec is an instance")
            pull = codec if self.codec.capabilities.merges else "dense"
        self.push_tx = build_codec(codec, rank=group.rank)
        self.pull_codec = build_codec(pull, mode="pull", rank=group.world)
        pull_caps = self.pull_codec.capabilities
        replaces = pull_caps.in_place and not pull_caps.lossy_tolerant  # the pulled model is the whole replica
        if not (pull_caps.merges or replaces):
            raise ValueError(f"a compressed pull needs a codec with merge semantics (slimdp), not "
                             f"{self.pull_codec.name!r}")
        cfg = group.endpoint.cfg
        for c in (self.codec, self.pull_codec):
            if cfg.error_feedback and c.capabilities.lossy_tolerant \
                    and not c.capabilities.transport_feedback:
                raise ValueError(f"codec {c.name!r} must not get the transport's error feedback (lost blocks folded "
                                 f"into the next round): open the group with TransportConfig(error_feedback=False)")
        # the pull's frames carry the pull codec's id (the push's carry the push codec's): a rank built with another
        # pull codec meets RankMismatch on the first pulled message, as with another push codec
        self.pull_code = call_code("sum", self.pull_codec.name)
        self.is_server = group.rank == server
        self.w = flat.clone() if self.is_server else None
        self.push_tx_state = self._state()
        self.pull_rx_state = self._state()
        self.push_rx_states = {w: self._state() for w in self.workers} if self.is_server else {}
        self.pull_tx_state = self._state() if self.is_server else None
        self._templates: dict[int, list[Part]] = {}

    def peers(self) -> list[int]:
        g = self.group
        return [r for r in range(g.world) if r != g.rank] if g.rank == self.server else [self.server]

    def _state(self) -> BucketState:
        st = BucketState(self.numel, self.dtype)
        set_segments(st, self.segments)
        return st

    # -- one round ------------------------------------------------------------------------------------------------
    @tells_peers
    @one_error
    async def step(self, delta: torch.Tensor | None, local: torch.Tensor | None) -> CollectiveResult:
        """Push ``delta`` (this rank's accumulated gradient), pull, and return ``local`` merged with the pull.

        A server that does not train passes None for both and gets its model ``w`` back (a copy).

        With ``every=p`` (Slim-DP's communication frequency) only every p-th call communicates: the other calls add
        ``delta`` to a pending sum and return ``local`` unchanged (the server's ``w``), with empty stats, so that the
        p-th call pushes the delta accumulated over p mini-batches. Every rank must call step equally often.

        With ``average=True`` (Oland & Raj's model averaging) a worker pushes its parameters ``local`` (``delta`` is
        ignored), the server sets ``w`` to the mean of the decoded pushes and every worker continues from it."""
        g = self.group
        stats = ModelServerStats()
        trains = not self.is_server or self.server_trains
        if trains:
            delta, local = await self._inputs(delta, local)
        if self.every > 1:
            delta, only_accumulates = self._accumulate(delta, trains)
            if only_accumulates:
                return CollectiveResult(local if trains else self.w.clone(), stats)
        if g.world > 1:
            # workers-server, on the first call that communicates: a step that only accumulates (every=p) must not
            # dial, or a server's last local step re-dialled workers that had finished and closed (PeerTimeout)
            await self.connect()
        rnd = g.next_round("model-server", self.bucket_id)
        parts = self.push_tx.encode(delta.detach().reshape(-1), self.push_tx_state) if trains else []
        if not self.is_server:
            with self.phase(stats, "push"):
                await self._send(self.server, "push", rnd, parts, stats)
            with self.phase(stats, "pull"):
                got = await self._recv(self.server, "pull", rnd, self.pull_codec, stats)
                out = self._merge(got, local)
            return CollectiveResult(out, stats)
        received: dict[int, list[Received]] = {}
        if trains:
            received[g.rank] = [as_received(p) for p in parts]

        async def gather(w: int) -> None:
            received[w] = await self._recv(w, "push", rnd, self.codec, stats)

        with self.phase(stats, "gather"):
            async with open_nursery() as nursery:
                for w in self.workers:
                    if w != g.rank:
                        nursery.start_soon(gather, w)
        with self.phase(stats, "update"):
            self._update(received)
        with self.phase(stats, "pull"):
            pull = self.pull_codec.encode(self.w, self.pull_tx_state)
            async with open_nursery() as nursery:
                for w in self.workers:
                    if w != g.rank:
                        nursery.start_soon(self._send, w, "pull", rnd, pull, stats)
                if trains:
                    out = self._merge([as_received(p) for p in pull], local)
                else:
                    out = self.w.clone()
        return CollectiveResult(out, stats)

    async def _inputs(self, delta: torch.Tensor | None, local: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """A training rank's (delta, local) as this server reads them (model averaging pushes ``local`` itself);
        refused (:class:`InputRejected`) before any traffic, told to the call's peers, which took a round for it and
        fail now instead of at peer_timeout."""
        try:
            if local is None or (delta is None and not self.average):
                raise InputRejected("a training rank passes its delta and its local model")
            local = self._check_input(local, "local")
            return (local if self.average else self._check_input(delta, "delta")), local
        except InputRejected as exc:
            before = self.group.round_of("model-server", self.bucket_id)
            await _refuse(self, exc, "model-server", self.bucket_id, before)
            raise

    def _check_input(self, t: torch.Tensor | None, what: str) -> torch.Tensor:
        """``t`` (``delta`` or ``local``) as this server reads it, any layout (:func:`plain_input`), or
        :class:`InputRejected` before any traffic: what is not a dense tensor, or one of another size or dtype than
        the model this server was made with (every rank's model is the same: a rank whose model differs is the
        ranks' disagreement, seen on the first message)."""
        t = plain_input(t, what)
        if t.numel() != self.numel or t.dtype != self.dtype:
            raise InputRejected(f"{what} must be a {self.dtype} tensor of {self.numel} elements like the model, not "
                                f"{t.dtype} x {t.numel()}")
        self.codec.check_input(t)
        return t

    def _accumulate(self, delta: torch.Tensor | None, trains: bool) -> tuple[torch.Tensor | None, bool]:
        """``every=p``: this call's ``delta`` into the pending sum; (the delta to push, whether this call only
        accumulates: every call but each p-th)."""
        self._calls += 1
        if trains and not self.average:
            d = delta.detach().reshape(-1)
            self._pending = d.clone() if self._pending is None else self._pending.add_(d)
        if self._calls % self.every:
            return delta, True
        if not self.average:
            delta, self._pending = self._pending, None
        return delta, False

    def _update(self, received: dict[int, list[Received]]) -> None:
        """The server's model from every worker's decoded push: their mean (``average``) or one SGD step."""
        like = self.w
        rnd = self.group.round_of("model-server", self.bucket_id)
        decoded = [decode_parts(self.codec, received[w], self.push_rx_states[w], like, w, rnd).to(like.dtype)
                   for w in self.workers]
        if self.average:  # the same reduction as simulate.train_model_averaging
            self.w = torch.stack(decoded).mean(0)
        else:
            agg = self.codec.aggregate(decoded)
            self.w -= self.lr * agg

    def _merge(self, got: list[Received], local: torch.Tensor) -> torch.Tensor:
        flat = local.detach().reshape(-1)
        if self.pull_codec.capabilities.merges:
            try:
                out = self.pull_codec.merge(got, self.pull_rx_state, flat)
            except (ValueError, RuntimeError, IndexError) as exc:  # a pull that does not merge into this replica
                if isinstance(exc, DgtError):
                    raise
                rnd = self.group.round_of("model-server", self.bucket_id)
                raise RankMismatch(shape_mismatch(rnd), detail=f"the server's pull does not merge into {flat.numel()} "
                                   f"x {flat.dtype}: {exc}") from exc
        else:  # dense: the pulled model replaces the replica
            rnd = self.group.round_of("model-server", self.bucket_id)
            out = decode_parts(self.pull_codec, got, self.pull_rx_state, flat, self.server, rnd).to(flat.dtype)
            if self.w is not None and out.untyped_storage().data_ptr() == self.w.untyped_storage().data_ptr():
                out = out.clone()  # the server's own replica must not alias w
        return out.view_as(local)

    # -- moving parts ---------------------------------------------------------------------------------------------
    async def _send(self, peer: int, phase: str, rnd: int, parts: list[Part], stats: CollectiveStats) -> None:
        # droppable parts wait for the receiver's drop report: once the last pull returns, every worker has closed
        # its rounds, so ranks may close their endpoints right after the last step
        # the call code (the push codec and op) in every frame: a peer that called with another codec raises
        # RankMismatch on the first message, and so does every rank (tells_peers)
        await send_parts(self.group.endpoint, peer, self.bucket_id, phase, 0, rnd, parts, stats, op=self._code(phase))

    def _code(self, phase: str) -> int:
        """The call code of ``phase``'s messages: the push codec's, or the pull codec's for the pull."""
        return self.pull_code if phase == "pull" else self.call_code

    async def _recv(self, peer: int, phase: str, rnd: int, codec: Codec, stats: ModelServerStats) -> list[Received]:
        """The parts ``peer`` sent, in the codec's block geometry, on this collective's device."""
        ep = self.group.endpoint
        like = torch.empty(0, dtype=self.dtype)
        results: list = []
        if codec.capabilities.header_part:  # header first: it says how many parts follow and how they are cut
            results.append(await ep.recv_round(peer, transport_key(self.bucket_id, phase, 0, 0), rnd))
            check_op(self._code(phase), results[0].codec, rnd)
            try:
                geometry = codec.wire_parts(results[0].data, like)
            except (ValueError, RuntimeError, IndexError) as exc:  # a header for another model
                if isinstance(exc, DgtError):
                    raise
                raise RankMismatch(shape_mismatch(rnd), detail=f"rank {peer}'s header part: {exc}") from exc
        else:
            geometry = self._template(codec)
        results += [None] * (len(geometry) - len(results))

        async def one(i: int) -> None:
            results[i] = await ep.recv_round(peer, transport_key(self.bucket_id, phase, 0, i), rnd)
            check_op(self._code(phase), results[i].codec, rnd)  # on arrival: another codec's other parts never come

        async with open_nursery() as nursery:
            for i in range(len(geometry)):
                if results[i] is None:
                    nursery.start_soon(one, i)
        out = []
        for res, part in zip(results, geometry):
            stats.add_round(res.stats)
            n = res.data.numel()
            if codec.capabilities.variable_length:  # self-describing reliable parts (Oland-Raj's Huffman)
                part = Part(res.data, part.lane_class, part.block_elems, part.name, [n])
            elif n != part.data.numel() or res.data.dtype != part.data.dtype:  # the peer's model differs from ours
                raise RankMismatch(shape_mismatch(rnd), detail=f"part {part.name!r} from rank {peer}: {n} x "
                                   f"{res.data.dtype}, this rank expects {part.data.numel()} x {part.data.dtype}")
            clayout = part.layout
            mask = clayout.whole_blocks(res.mask, res.layout)
            lost = clayout.block_len[~mask]
            stats.lost_blocks[part.name] = stats.lost_blocks.get(part.name, 0) + lost.numel()
            stats.lost_elems[part.name] = stats.lost_elems.get(part.name, 0) + int(lost.sum())
            data = res.data.to(self.device)
            out.append(Received(data, mask.to(self.device), part.block_elems, part.segments))
        return out

    def _template(self, codec: Codec) -> list[Part]:
        """Part geometry of a codec whose messages always look alike (dense, qsgd): one encoding of zeros."""
        key = id(codec)
        if key not in self._templates:
            zeros = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
            parts = codec.encode(zeros, self._state())
            self._templates[key] = [Part(p.data, p.lane_class, p.block_elems, p.name, p.segments) for p in parts]
        return self._templates[key]

