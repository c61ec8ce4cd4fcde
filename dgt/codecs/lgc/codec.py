"""LGC as a DGT codec: the per-rank math of both variants behind encode / decode / aggregate.

The codec never does I/O. The communication choreography around it (who sends what to whom, when) lives in
:class:`dgt.codecs.lgc.runner.LGCRunner`, which drives any :class:`~dgt.codecs.lgc.comm.Comm`. What the plain codec
contract cannot express is exposed as extra methods the runner (or a collective) calls:

* both variants: ``setup(worker, workers)``, ``set_layers(sizes, roles, bucket_id)``, and the one-time transfer of
  trained autoencoder weights: ``control_out(state)`` on the trainer / server, ``expects_control(state)`` +
  ``control_in(data, state)`` on the receivers.
* ring: ``selector(state)`` (shared-seed choice of the rank that picks the indices), ``select(bucket, state)`` on that
  rank (its DEFLATE-coded indices, to be broadcast), ``accept_selection(parts, state)`` on every rank before
  ``encode``; ``reduction(parts, state)`` says which parts are summed and which are all-gathered (the AE-training phase
  gathers the aligned vectors to the trainer), ``train_ring(gathered, state, rank)``.

Part order is fixed per (variant, phase, leader-or-not), so ``decode`` needs no part names: the PS payload starts with
a 3-byte meta part (phase, worker index) and the ring phase is known to every rank in lock-step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dgt.codecs.base import RELIABLE, BucketState, Capabilities, Codec, Part, Received
from dgt.codecs.lgc.autoencoder import LATENT_CHANNELS, Decoder, Encoder, PSAutoencoder, RingAutoencoder, to_signal
from dgt.codecs.lgc.plan import LayerPlan, LGCConfig, Phase
from dgt.codecs.lgc.replay import replay_batch
from dgt.codecs.lgc.wire import (
    decode_index_list,
    decode_indices,
    encode_index_list,
    encode_indices,
    flatten_module_state,
    load_module_state,
)
from dgt.codecs.registry import register


def _rms(x: torch.Tensor) -> torch.Tensor:
    """RMS of a vector as a 1-element tensor (1 where the vector is all zero)."""
    s = x.pow(2).mean().sqrt().reshape(1) if x.numel() else x.new_ones(1)
    return torch.where(s > 0, s, torch.ones_like(s))


def _data(p: Part | Received | torch.Tensor) -> torch.Tensor:
    return p if isinstance(p, torch.Tensor) else p.data


@register("lgc")
class LGCCodec(Codec):
    """Learned gradient compression. Options: see :class:`~dgt.codecs.lgc.plan.LGCConfig` (``lgc:variant=ring,...``)."""

    name = "lgc"
    # its three phases, the autoencoder training and the per-step index exchange need a driver of their own: the
    # generic collectives refuse it at construction instead of failing inside a round
    runner = "dgt.codecs.lgc.runner.LGCRunner (see docs/lgc.md, `dgt bench lgc`)"

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.config = LGCConfig.from_kwargs(**options)
        ring = self.config.variant == "ring"
        # ring: latent codes (and aligned top-k values) add up element-wise; PS: the server must see every rank's
        # payload (per-worker decoders, leader code), so gather-then-reduce with server-side state.
        self.capabilities = Capabilities(summable=ring, lossy_tolerant=False, stateful_server=not ring)
        self.worker = 0
        self.workers = 1
        self._plans: dict[int, LayerPlan] = {}
        self._origin: dict[int, BucketState] = {}

    # -- set-up ------------------------------------------------------------------------------------------------
    def setup(self, *, worker: int, workers: int) -> LGCCodec:
        """This rank's index among the K workers (-1 on a dedicated PS server) and K."""
        if workers < 1 or worker >= workers:
            raise ValueError(f"bad worker {worker} of {workers}")
        self.worker, self.workers = worker, workers
        return self

    def set_layers(self, sizes: list[int] | tuple[int, ...], roles: list[str] | tuple[str, ...] | None = None,
                   bucket_id: int = 0) -> LayerPlan:
        """Declare the layers packed in bucket ``bucket_id`` (default roles: first dense, last top-k, rest AE).
        Without this call a bucket is one autoencoder-coded layer."""
        plan = LayerPlan(sizes, roles, self.config.topk)
        self._plans[bucket_id] = plan
        return plan

    def state_for(self, bucket_id: int, bucket: torch.Tensor) -> BucketState:
        st = super().state_for(bucket_id, bucket)
        if "plan" not in st.values:
            plan = self._plans.get(bucket_id) or LayerPlan([bucket.numel()], ("ae",), self.config.topk)
            if plan.numel != bucket.numel():
                raise ValueError(f"bucket {bucket_id} has {bucket.numel()} elements, its layers {plan.numel}")
            st.values["plan"] = plan
        return st

    def _plan(self, state: BucketState) -> LayerPlan:
        plan = state.values.get("plan")
        if plan is None:
            plan = state.values["plan"] = LayerPlan([state.numel], ("ae",), self.config.topk)
        return plan

    def phase(self, state: BucketState) -> Phase:
        """Phase of the next round this rank encodes."""
        return self.config.phase(state.step)

    # -- shared pieces -----------------------------------------------------------------------------------------
    def _sparsify(self, g: torch.Tensor, state: BucketState, idx: dict[str, torch.Tensor] | None = None,
                  commit: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Error feedback (optionally DGC momentum correction) + exact top-k per sparse layer.

        v = acc + g (or u = m u + g; v = acc + u); selection on v unless ``idx`` is given; on commit the selected
        entries leave the accumulator (and the momentum) and the rest stays for later rounds.
        """
        cfg, plan = self.config, self._plan(state)
        acc = state.values.get("acc")
        if acc is None:
            acc = torch.zeros_like(g)
        if cfg.momentum_correction:
            u = state.values.get("mom")
            u = g.clone() if u is None else u.mul(cfg.momentum).add_(g)
            v = acc + u
        else:
            u = None
            v = acc + g
        if idx is None:
            idx = {role: plan.select(v, role) for role in ("topk", "ae")}
        if commit:
            chosen = torch.cat([idx["topk"], idx["ae"]])
            new_acc = v.clone()
            new_acc[chosen] = 0
            if plan.layers("dense"):
                plan.set_region(new_acc, "dense", torch.zeros_like(g))
            state.values["acc"] = new_acc
            if u is not None:
                u[chosen] = 0
                state.values["mom"] = u
        return v, idx

    def _sends_code(self, worker: int) -> bool:
        """PS compressed phase: does this worker send a latent code (the leader; every worker with ps_codes=all)?"""
        return self.config.ps_codes == "all" or worker == self.config.leader

    def _n_innovation(self, mu: int) -> int:
        return min(mu, max(1, math.ceil(self.config.innovation * mu)))

    def _order_ae(self, v: torch.Tensor, idx: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``ae_order=value``: the AE-layer indices in descending order of their values in ``v``, so the vector the
        autoencoder sees is monotone (a smooth, compressible curve) and the receiver learns the order from the index
        list. ``ae_order=index``: ascending index order (layer order)."""
        if self.config.ae_order != "value" or idx["ae"].numel() < 2:
            return idx
        order = torch.argsort(v[idx["ae"]], descending=True, stable=True)
        return {**idx, "ae": idx["ae"][order]}

    def _enc_ae_idx(self, idx: torch.Tensor) -> torch.Tensor:
        return encode_index_list(idx) if self.config.ae_order == "value" else encode_indices(idx)

    def _dec_ae_idx(self, buf: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
        return decode_index_list(buf, device) if self.config.ae_order == "value" else decode_indices(buf, device)

    def _note_target(self, state: BucketState, x: torch.Tensor) -> None:
        """Running mean of the (normalised) AE training targets: the 'template' baseline a code-free decoder could
        output; kept for the diagnostics only (never sent)."""
        tot = state.values.get("ae_target_sum")
        state.values["ae_target_sum"] = x.detach().clone() if tot is None else tot + x.detach()
        state.values["ae_target_n"] = state.values.get("ae_target_n", 0) + 1

    def template(self, state: BucketState) -> torch.Tensor | None:
        tot = state.values.get("ae_target_sum")
        return None if tot is None else tot / state.values["ae_target_n"]

    def _record(self, state: BucketState, **entry: Any) -> None:
        if self.config.record:
            rec = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items()}
            state.values.setdefault("diag", []).append({"step": state.step, **rec})

    def _dense_parts(self, g: torch.Tensor, plan: LayerPlan, phase: Phase) -> list[Part]:
        parts = []
        roles = ("dense", "topk", "ae") if phase == Phase.DENSE else ("dense",)
        for role in roles:
            if plan.layers(role):
                parts.append(Part(plan.region(g, role), RELIABLE, name=f"{role}:vals"))
        return parts

    def layout(self, phase: Phase, plan: LayerPlan, leader: bool = False) -> list[str]:
        """Names of the parts ``encode`` emits, in order (ring: without the meta part)."""
        ps = self.config.variant == "ps"
        names = ["meta"] if ps else []
        roles = ("dense", "topk", "ae") if phase == Phase.DENSE else ("dense",)
        names += [f"{r}:vals" for r in roles if plan.layers(r)]
        if phase == Phase.DENSE:
            return names
        if plan.layers("topk"):
            names += ["topk:vals", "topk:idx"] if ps else ["topk:vals"]
        if plan.layers("ae"):
            if phase == Phase.TOPK:
                names += ["ae:vals", "ae:idx"] if ps else ["ae:vals"]
            elif ps:
                names += (["ae:code"] if leader else []) + ["ae:scale", "ae:ipos", "ae:ivals", "ae:idx"]
            else:
                names += ["ae:code"]
        return names

    # -- encode ------------------------------------------------------------------------------------------------
    def encode(self, bucket: torch.Tensor, state: BucketState) -> list[Part]:
        if self.config.variant == "ps":
            parts = self._encode_ps(bucket, state)
        else:
            parts = self._encode_ring(bucket, state)
        state.step += 1
        return parts

    def _encode_ps(self, bucket: torch.Tensor, state: BucketState) -> list[Part]:
        cfg, plan = self.config, self._plan(state)
        g = bucket.detach().reshape(-1).float()
        phase = self.phase(state)
        if self.worker < 0:
            raise RuntimeError("a dedicated PS server does not encode")
        meta = torch.tensor([int(phase), self.worker & 0xFF, self.worker >> 8], dtype=torch.uint8, device=g.device)
        parts = [Part(meta, RELIABLE, name="meta")] + self._dense_parts(g, plan, phase)
        if phase == Phase.DENSE:
            return parts
        v, idx = self._sparsify(g, state)
        idx = self._order_ae(v, idx)
        if plan.layers("topk"):
            parts += [Part(v[idx["topk"]], name="topk:vals"), Part(encode_indices(idx["topk"]), name="topk:idx")]
        if not plan.layers("ae"):
            return parts
        x = v[idx["ae"]]
        if phase == Phase.TOPK:
            return parts + [Part(x, name="ae:vals"), Part(self._enc_ae_idx(idx["ae"]), name="ae:idx")]
        scale = _rms(x) if cfg.normalize else x.new_ones(1)
        self._record(state, worker=self.worker, idx=idx["ae"], x=x, scale=scale)
        if self._sends_code(self.worker):
            enc = state.values.get("encoder")
            if enc is None:
                raise RuntimeError("the PS leader has no trained encoder (control_in was not called)")
            with torch.no_grad():
                code = enc(to_signal(x / scale)).reshape(-1)
            parts.append(Part(code, name="ae:code"))
        pos = torch.sort(torch.topk(x.abs(), self._n_innovation(x.numel()), sorted=False).indices).values
        if cfg.ae_ef:
            self._ps_feedback(state, x, code, scale, pos, idx["ae"])
        parts += [Part(scale, name="ae:scale"), Part(encode_indices(pos), name="ae:ipos"),
                  Part(x[pos], name="ae:ivals"), Part(self._enc_ae_idx(idx["ae"]), name="ae:idx")]
        return parts

    def _ps_feedback(self, state: BucketState, x: torch.Tensor, code: torch.Tensor, scale: torch.Tensor,
                     pos: torch.Tensor, idx: torch.Tensor) -> None:
        """``ae_ef``: decode this worker's own frame as the server will (its decoder, the same code and innovation)
        and leave the difference to the true values in the error-feedback accumulator (instead of zeros)."""
        cfg = self.config
        with torch.no_grad():
            if cfg.ae_ablate == "zero":
                rec = torch.zeros_like(x)
            elif cfg.ae_ablate == "template":
                rec = state.values["ae_template"].to(x) * scale
            else:
                innov = torch.zeros_like(x)
                innov[pos] = x[pos] / scale
                sig = state.values["decoder"](code.reshape(1, LATENT_CHANNELS, -1), to_signal(innov))
                rec = sig.reshape(-1)[: x.numel()] * scale
        if cfg.exact_innovation:
            rec[pos] = x[pos]
        state.values["acc"][idx] = x - rec

    # -- PS server: decode + aggregate ---------------------------------------------------------------------------
    def decode(self, parts: list[Received], state: BucketState, like: torch.Tensor) -> torch.Tensor:
        if self.config.variant == "ps":
            return self._decode_ps(parts, state, like)
        return self._decode_ring(parts, state, like)

    def _decode_ps(self, parts: list[Received], state: BucketState, like: torch.Tensor) -> torch.Tensor:
        plan = self._plan(state)
        meta = _data(parts[0]).to("cpu", torch.int64).tolist()
        phase, worker = Phase(meta[0]), meta[1] | (meta[2] << 8)
        names = self.layout(phase, plan, leader=self._sends_code(worker))
        if len(names) != len(parts):
            raise ValueError(f"LGC PS payload of worker {worker}: {len(parts)} parts, expected {names}")
        d, out = self._dense_regions(names, parts, plan, phase, like.device)
        dev = like.device
        stash = state.values.setdefault("srv_stash", {})
        if phase != Phase.DENSE and plan.layers("topk"):
            out[decode_indices(d["topk:idx"], dev)] = d["topk:vals"].to(dev).float()
        if phase == Phase.TOPK and plan.layers("ae"):
            vals = d["ae:vals"].to(dev).float()
            out[self._dec_ae_idx(d["ae:idx"], dev)] = vals
            stash[worker] = ("train", vals)
        elif phase == Phase.COMPRESSED and plan.layers("ae"):
            stash[worker] = ("comp", {k: v.to(dev) for k, v in d.items() if k.startswith("ae:")})
        res = out.to(like.dtype)
        self._origin[id(res)] = state  # aggregate() finds the server state through the tensors it is given
        return res

    def aggregate(self, decoded: list[torch.Tensor]) -> torch.Tensor:
        """Sum of the decoded payloads; for PS also the server's autoencoder work on what ``decode`` stashed:
        one training step in the top-k phase, the reconstruction of every worker's AE layers in the compressed one."""
        state = self._origin.pop(id(decoded[0]), None)
        for t in decoded[1:]:
            self._origin.pop(id(t), None)
        total = super().aggregate(decoded)
        if state is None or self.config.variant != "ps":
            return total
        stash = state.values.get("srv_stash") or {}
        if not stash:
            return total
        state.values["srv_stash"] = {}
        kinds = {kind for kind, _ in stash.values()}
        if len(kinds) != 1 or len(stash) != self.workers:
            raise RuntimeError(f"LGC PS server got {sorted(stash)} of {self.workers} workers, phases {kinds}")
        if kinds == {"train"}:
            self._ps_train(state, torch.stack([stash[w][1] for w in range(self.workers)]))
            return total
        with torch.no_grad():
            rec = self._ps_reconstruct(state, {w: stash[w][1] for w in range(self.workers)})
        return total + rec.to(total.dtype)

    def _server_ae(self, state: BucketState, device: torch.device) -> PSAutoencoder:
        ae = state.values.get("srv_ae")
        if ae is None:
            cfg = self.config
            ae = PSAutoencoder(self.workers, cfg.ae_opt, cfg.ae_lr, cfg.sim_weight, cfg.seed,
                               common=-1 if cfg.ps_codes == "all" else None if cfg.ps_common == "random"
                               else cfg.leader,
                               loss_sum=cfg.ae_loss == "sum").to(device)
            state.values["srv_ae"] = ae
        return ae

    def _ps_train(self, state: BucketState, x: torch.Tensor) -> None:
        cfg = self.config
        ae = self._server_ae(state, x.device)
        if cfg.normalize:
            x = x / x.pow(2).mean(1, keepdim=True).sqrt().clamp_min(1e-30)
        self._note_target(state, x)
        pos = torch.topk(x.abs(), self._n_innovation(x.shape[1]), dim=1, sorted=False).indices
        innov = torch.zeros_like(x).scatter_(1, pos, x.gather(1, pos))
        xb, ib = replay_batch(state.values, cfg.ae_replay, cfg.seed, x, innov)
        logs = [ae.train_step(xb, ib) for _ in range(cfg.ae_steps)]
        state.values.setdefault("ae_history", []).append(logs[0])  # measured before this round's update
        state.values["srv_trained"] = state.values.get("srv_trained", 0) + 1
        if state.values["srv_trained"] == cfg.ae_iters:
            to = range(self.workers) if cfg.ps_codes == "all" else (cfg.leader,)
            state.values["srv_outbox"] = [(w, Part(self._ps_weights(state, ae, w), name="ctl:encoder")) for w in to]

    def _ps_weights(self, state: BucketState, ae: PSAutoencoder, worker: int) -> torch.Tensor:
        """What the server ships to a worker once: the encoder; with ``ae_ef`` also that worker's decoder (and with
        the template ablation its template), so the worker can compute what the server will decode."""
        weights = [flatten_module_state(ae.encoder)]
        if self.config.ae_ef:
            weights.append(flatten_module_state(ae.decoders[worker]))
            if self.config.ae_ablate == "template":
                weights.append(self.template(state)[worker].reshape(-1).to(weights[0]))
        return torch.cat(weights)

    def _ps_reconstruct(self, state: BucketState, comp: dict[int, dict[str, torch.Tensor]]) -> torch.Tensor:
        cfg, plan = self.config, self._plan(state)
        leader = comp.get(cfg.leader, {})
        if "ae:code" not in leader:
            raise RuntimeError("LGC PS: the leader's latent code is missing")
        dev = leader["ae:code"].device
        ae = self._server_ae(state, dev)
        mu = plan.mu("ae")
        out = torch.zeros(plan.numel, dtype=torch.float32, device=dev)
        tmpl = self.template(state) if cfg.record or cfg.ae_ablate == "template" else None
        for w in range(self.workers):
            d = comp[w]
            scale = d["ae:scale"].float()
            pos = decode_indices(d["ae:ipos"], dev)
            ivals = d["ae:ivals"].float()
            innov = torch.zeros(mu, device=dev)
            innov[pos] = ivals / scale
            code = (d if cfg.ps_codes == "all" else leader)["ae:code"].float()
            rec = ae.decode(w, code, innov, mu) * scale
            if cfg.ae_ablate == "zero":
                rec = torch.zeros_like(rec)
            elif cfg.ae_ablate == "template":  # a code-free decoder: the mean training target, rescaled
                rec = tmpl[w].to(dev) * scale
            if cfg.exact_innovation:
                rec[pos] = ivals
            idx = self._dec_ae_idx(d["ae:idx"], dev)
            out[idx] += rec
            if cfg.record:  # the code-free decoders on the same vectors, with what they would write back too
                base = tmpl[w] * scale if tmpl is not None else torch.zeros_like(rec)
                zero = torch.zeros_like(rec)
                if cfg.exact_innovation:
                    base[pos] = ivals
                    zero[pos] = ivals
                self._record(state, worker=w, idx=idx, rec=rec, template=base, zero=zero)
        return out

    # -- control: trained weights, shipped once ------------------------------------------------------------------
    def control_out(self, state: BucketState) -> list[tuple[int | None, Part]]:
        """Pending one-time messages of the AE owner: (destination worker, or None = broadcast, part)."""
        return state.values.pop("srv_outbox", [])

    def expects_control(self, state: BucketState) -> bool:
        """True on a rank that must receive the trained weights now (after its last top-k round)."""
        if state.step != self.config.switch_step:
            return False
        if self.config.variant == "ps":
            return self._sends_code(self.worker) and "encoder" not in state.values
        return not state.values.get("ae_loaded", False)

    def control_in(self, data: torch.Tensor, state: BucketState) -> None:
        cfg = self.config
        if cfg.variant == "ps":
            data = data.float()
            enc = Encoder().to(data.device)
            data = load_module_state(enc, data, partial=True)
            state.values["encoder"] = enc.eval()
            if cfg.ae_ef:
                dec = Decoder(innovation=True).to(data.device)
                state.values["ae_template"] = load_module_state(dec, data, partial=True)
                state.values["decoder"] = dec.eval()
        else:
            ae = RingAutoencoder(cfg.ae_opt, cfg.ae_lr).to(data.device)
            data = data.float()
            if cfg.ae_ablate == "template":  # weights + the template (mu floats), see train_ring
                n = sum(t.numel() for t in ae.state_dict().values())
                data, tmpl = data[:n], data[n:]
                state.values["ae_target_sum"], state.values["ae_target_n"] = tmpl.clone(), 1
            load_module_state(ae, data)
            state.values["ring_ae"] = ae
            state.values["ae_loaded"] = True

    # -- ring ----------------------------------------------------------------------------------------------------
    def selector(self, state: BucketState) -> int:
        """The rank that picks this round's indices: a shared-seed draw, so every rank agrees without a message."""
        gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + state.step)
        return int(torch.randint(self.workers, (1,), generator=gen))

    def select(self, bucket: torch.Tensor, state: BucketState) -> list[Part]:
        """On the selector: its top-k indices per sparse layer (DEFLATE-coded) and, when compressing with
        normalisation, the RMS of its selected AE-layer values (the common scale). Does not change the state."""
        g = bucket.detach().reshape(-1).float()
        plan, phase = self._plan(state), self.phase(state)
        v, idx = self._sparsify(g, state, commit=False)
        idx = self._order_ae(v, idx)
        parts = [Part(encode_indices(idx["topk"]), name="topk:idx")] if plan.layers("topk") else []
        if plan.layers("ae"):
            parts.append(Part(self._enc_ae_idx(idx["ae"]), name="ae:idx"))
        if phase == Phase.COMPRESSED and plan.layers("ae"):
            scale = _rms(v[idx["ae"]]) if self.config.normalize else g.new_ones(1)
            parts.append(Part(scale, name="ae:scale"))
        return parts

    def selection_layout(self, state: BucketState) -> list[str]:
        plan = self._plan(state)
        names = [f"{r}:idx" for r in ("topk", "ae") if plan.layers(r)]
        if self.phase(state) == Phase.COMPRESSED and plan.layers("ae"):
            names.append("ae:scale")
        return names

    def accept_selection(self, parts: list[Part | Received | torch.Tensor], state: BucketState,
                         device: torch.device | str | None = None) -> None:
        names = self.selection_layout(state)
        if len(parts) != len(names):
            raise ValueError(f"selection has {len(parts)} parts, expected {names}")
        d = {n: _data(p) for n, p in zip(names, parts)}
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        sel = {"topk": decode_indices(d["topk:idx"], device) if "topk:idx" in d else empty,
               "ae": self._dec_ae_idx(d["ae:idx"], device) if "ae:idx" in d else empty}
        sel["scale"] = d["ae:scale"].to(device).float() if "ae:scale" in d else None
        state.values["sel"] = sel

    def _encode_ring(self, bucket: torch.Tensor, state: BucketState) -> list[Part]:
        plan = self._plan(state)
        g = bucket.detach().reshape(-1).float()
        phase = self.phase(state)
        state.values["last_phase"] = phase
        state.values["last_selector"] = self.selector(state)
        parts = self._dense_parts(g, plan, phase)
        if phase == Phase.DENSE:
            return parts
        sel = state.values.pop("sel", None)
        if sel is None:
            raise RuntimeError("ring LGC: accept_selection must run before encode in the top-k and compressed phases")
        idx = {r: sel[r].to(g.device) for r in ("topk", "ae")}
        v, _ = self._sparsify(g, state, idx=idx)
        state.values["last_idx"] = idx
        if plan.layers("topk"):
            parts.append(Part(v[idx["topk"]], name="topk:vals"))
        if not plan.layers("ae"):
            return parts
        x = v[idx["ae"]]
        if phase == Phase.TOPK:
            return parts + [Part(x, name="ae:vals")]
        ae = state.values.get("ring_ae")
        if ae is None:
            raise RuntimeError("ring LGC: no trained autoencoder (control_in was not called)")
        scale = sel["scale"].to(g.device) if sel["scale"] is not None else g.new_ones(1)
        state.values["last_scale"] = scale
        if self.config.record or self.config.ae_ef:
            state.values["last_x"] = x
        with torch.no_grad():
            code = ae.encode(x / scale).reshape(-1)
        return parts + [Part(code, name="ae:code")]

    def reduction(self, parts: list[Part], state: BucketState) -> list[str]:
        """Per part of the round just encoded: "sum" (all-reduce) or "gather" (all-gather: the top-k phase's AE-layer
        vectors, which the trainer learns from)."""
        gather = self.config.variant == "ring" and state.values.get("last_phase") == Phase.TOPK
        return ["gather" if gather and p.name == "ae:vals" else "sum" for p in parts]

    def train_ring(self, gathered: list[torch.Tensor], state: BucketState, rank: int) -> None:
        """One AE training iteration on the ring trainer (no-op elsewhere); ``gathered``: all ranks' aligned vectors."""
        cfg = self.config
        if rank != cfg.trainer:
            return
        x = torch.stack([t.float() for t in gathered])
        ae = state.values.get("ring_ae")
        if ae is None:
            ae = state.values["ring_ae"] = RingAutoencoder(cfg.ae_opt, cfg.ae_lr, cfg.seed,
                                                                  loss_sum=cfg.ae_loss == "sum").to(x.device)
        if cfg.normalize:
            x = x / _rms(x[state.values["last_selector"]])
        self._note_target(state, x.mean(0))
        (xb,) = replay_batch(state.values, cfg.ae_replay, cfg.seed, x)
        logs = [ae.train_step(xb) for _ in range(cfg.ae_steps)]
        state.values.setdefault("ae_history", []).append(logs[0])  # measured before this round's update
        state.values["ring_trained"] = state.values.get("ring_trained", 0) + 1
        if state.values["ring_trained"] == cfg.ae_iters:
            weights = flatten_module_state(ae)
            if cfg.ae_ablate == "template":  # the code-free ablation decoder needs the template on every rank
                weights = torch.cat([weights, self.template(state).reshape(-1).to(weights)])
            state.values["srv_outbox"] = [(None, Part(weights, name="ctl:ae"))]

    @staticmethod
    def _dense_regions(names: list[str], parts: list[Received], plan, phase, dev) -> tuple[dict, torch.Tensor]:
        """The parts by name, and the decoded bucket with the regions sent as plain values filled in (dense layers
        always; every layer in the dense phase)."""
        d = {n: _data(p) for n, p in zip(names, parts)}
        out = torch.zeros(plan.numel, dtype=torch.float32, device=dev)
        for role in ("dense", "topk", "ae"):
            if f"{role}:vals" in d and (role == "dense" or phase == Phase.DENSE):
                plan.set_region(out, role, d[f"{role}:vals"].to(dev).float())
        return d, out

    def _decode_ring(self, parts: list[Received], state: BucketState, like: torch.Tensor) -> torch.Tensor:
        """Rebuild the SUM over ranks from the reduced parts (sum parts summed, gather parts: sum of the gathered)."""
        plan = self._plan(state)
        phase = state.values["last_phase"]
        names = self.layout(phase, plan)
        if len(names) != len(parts):
            raise ValueError(f"ring LGC: {len(parts)} parts, expected {names}")
        d, out = self._dense_regions(names, parts, plan, phase, like.device)
        dev = like.device
        if phase == Phase.DENSE:
            return out.to(like.dtype)
        idx = state.values["last_idx"]
        if plan.layers("topk"):
            out[idx["topk"]] = d["topk:vals"].to(dev).float()
        if phase == Phase.TOPK and plan.layers("ae"):
            out[idx["ae"]] = d["ae:vals"].to(dev).float()
        elif phase == Phase.COMPRESSED and plan.layers("ae"):
            k, scale = self.workers, state.values["last_scale"]
            with torch.no_grad():
                rec = state.values["ring_ae"].decode(d["ae:code"].to(dev).float() / k, plan.mu("ae"))
            tmpl = self.template(state)
            if self.config.ae_ablate == "zero":
                rec = torch.zeros_like(rec)
            elif self.config.ae_ablate == "template":  # a code-free decoder: the mean training target
                rec = tmpl.to(dev)
            out[idx["ae"]] = rec * scale * k
            x = state.values.pop("last_x", None)
            if self.config.ae_ef:  # this rank's share of the mean's reconstruction error stays in its accumulator
                state.values["acc"][idx["ae"]] = x - rec * scale
            if self.config.record:
                self._record(state, idx=idx["ae"], x=x, scale=scale, rec=rec * scale,
                             template=tmpl * scale if tmpl is not None else None)
        return out.to(like.dtype)

