"""Slim-DP (Sun et al., AAMAS 2018): send a core of the largest entries plus a random explorer, with key caching.

One codec serves both directions of the parameter-server collective:

- ``mode=push`` (workers -> server): ``encode`` selects from the gradient delta_k; ``decode`` gives the dense
  ``T_C(delta_k)`` (zeros outside the communication set and where explorer blocks were lost); ``aggregate`` sums
  (the server then applies ``w <- w - eta * sum_k``).
- ``mode=pull`` (server -> workers): the server encodes its freshly updated ``w`` (selection by |parameter|) once and
  sends the same parts to every worker; ``decode(parts, state, like=local_model)`` returns the merge: pulled
  coordinates overwrite the local model, the rest keep their local values (also where explorer blocks were lost).

Selection (global over the flat bucket, as in the paper; ``scope=tensor`` selects per tensor of
``state.values["segments"]``, a labelled deviation): core = top ``round((alpha - eps) N)`` by |value|, refreshed every
``q`` encodes; explorer = ``round(eps N)`` entries drawn uniformly without replacement from outside the core, redrawn
every encode. Both ends cache the core keys ("key caching"): between refreshes only the core values travel.

Wire format (all headers inside the parts, so ``sum(Part.nbytes)`` is exact):

=============  ==============  ===========================  =====================================================
part           dtype           lane                         size
=============  ==============  ===========================  =====================================================
header         int32           reliable                     6 values = 24 bytes: flags|version, core generation,
                                                            explorer draw seed, k_core, k_explorer, numel
core           bucket dtype    reliable                     k_core values, in ascending key order
core_keys      uint8           reliable                     only on refresh rounds: N-bit bitmap, ceil(N/8) bytes
explorer       uint8           ``explorer_lane`` (1)        k_explorer records (int32 key, value), 8 bytes for
                                                            fp32; a block holds whole records. With
                                                            ``shared_seed=true``: values only (keys regenerated)
=============  ==============  ===========================  =====================================================

fp32 steady state: 24 + 4 (alpha - eps) N + 8 eps N = 4 (alpha + eps) N + 24 bytes, i.e. (alpha + eps) N values'
worth plus the header; a refresh round adds ceil(N/8) bytes of bitmap (cheaper than (alpha - eps) N int32 keys).

No error feedback (the paper has none): unsent entries are dropped.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from dgt.codecs.base import DROPPABLE, RELIABLE, BucketState, Capabilities, Codec, Part, Received
from dgt.codecs.bucketinfo import element_mask_or_none, get_segments
from dgt.codecs.quantize import generator, mix_seed, pack_mask, unpack_mask
from dgt.codecs.registry import register

VERSION = 1
FLAG_REFRESH = 1
FLAG_SHARED_SEED = 2
HEADER_INTS = 6
HEADER_BYTES = 4 * HEADER_INTS
_EXPLORER_RECORDS_PER_BLOCK = 128
_SMALL = 1 << 20


# ---------------------------------------------------------------------------------------------------------------
# vectorised selection primitives
# ---------------------------------------------------------------------------------------------------------------


def _random16(n: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """``n`` iid uniform int16 values (64-bit random words split four ways)."""
    r = torch.empty(-(-n // 4), dtype=torch.int64, device=device).random_(-(2**63), 2**63 - 1, generator=gen)
    return r.view(torch.int16)[:n]


def topk_mask(a: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """Bool mask of exactly ``k`` largest entries of ``a`` (ties broken arbitrarily).

    Large inputs: a 64K-point sample brackets the threshold, every entry above the bracket is in, and a small
    ``topk`` inside the bracket settles the rest (a few O(N) passes instead of a partial sort). Falls back to
    ``torch.topk`` when the bracket misses (heavy ties, e.g. many exact zeros).
    """
    n = a.numel()
    mask = torch.zeros(n, dtype=torch.bool, device=a.device)
    if k <= 0:
        return mask
    if k >= n:
        return mask.fill_(True)
    if n > _SMALL:
        s = 1 << 16
        samp = a[torch.randint(n, (s,), generator=gen, device=a.device)].sort().values
        q = 1.0 - k / n
        sd = math.sqrt(s * q * (1 - q))
        lo_r = int(math.floor(q * s - 6 * sd - 4))
        hi_r = int(math.ceil(q * s + 6 * sd + 4))
        above = a > samp[hi_r] if hi_r < s else torch.zeros_like(mask)
        n_above = int(above.count_nonzero())
        band = (a > samp[lo_r]) if lo_r >= 0 else torch.ones_like(mask)
        band &= ~above
        bidx = band.nonzero().squeeze(1)
        if n_above <= k <= n_above + bidx.numel():
            need = k - n_above
            if need:
                sel = torch.topk(a[bidx], need, sorted=False).indices
                above[bidx[sel]] = True
            return above
    mask[torch.topk(a, k, sorted=False).indices] = True
    return mask


def _shared_draw(excluded: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """The explorer keys both ends derive from ``seed`` (shared-seed mode). Always drawn on the CPU, then moved:
    CPU and CUDA random streams differ, and a CPU server must find the keys a CUDA worker drew. Without a shared
    seed the keys travel, and the encoder draws them on the bucket's device instead."""
    return sample_outside(excluded.cpu(), k, generator("cpu", seed)).to(excluded.device)


def sample_outside(excluded: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """``k`` indices drawn uniformly without replacement from the positions where ``excluded`` is False (sorted).

    Bernoulli inclusion with a slightly raised rate, then a uniformly random set of the surplus is removed (or, if
    short, a uniformly random top-up is added): by exchangeability the result is a uniform k-subset.
    """
    n = excluded.numel()
    device = excluded.device
    free = n - int(excluded.count_nonzero())
    if k > free:
        raise ValueError(f"cannot draw {k} explorer entries from {free} free positions")
    if k == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    if n <= _SMALL:  # small buckets: k smallest of iid uniform keys over the free positions
        keys = torch.rand(n, generator=gen, device=device).masked_fill_(excluded, 2.0)
        return torch.topk(keys, k, largest=False, sorted=False).indices.sort().values
    p = k / free
    p = min(1.0, p + 4.0 * math.sqrt(p * (1 - p) / k) + 8.0 / free)
    thr = math.ceil(p * 65536) - 32768  # P(int16 < thr) = (thr + 32768) / 65536 >= p
    if thr >= 32768:
        cand = torch.ones(n, dtype=torch.bool, device=device)
    else:
        cand = _random16(n, gen, device) < thr
    cand.logical_and_(excluded.logical_not())
    idx = cand.nonzero().squeeze(1)
    c = idx.numel()
    if c > k:  # drop a uniformly random (c - k)-subset: distinct values of iid draws, then a random subset of those
        d = c - k
        if 8 * d > c:
            drop = torch.randperm(c, generator=gen, device=device)[:d]
        else:  # few to drop among many: distinct values of iid draws (>= d of them w.h.p.), then a random d of those
            draws = d + d // 4 + 16
            while True:
                pool = torch.randint(c, (draws,), generator=gen, device=device).unique()
                if pool.numel() >= d:
                    break
                draws *= 2
            drop = pool[torch.randperm(pool.numel(), generator=gen, device=device)[:d]]
        keep = torch.ones(c, dtype=torch.bool, device=device)
        keep[drop] = False
        idx = idx[keep]
    elif c < k:  # top up with k - c uniformly random free, not yet chosen positions
        rest = (~(cand | excluded)).nonzero().squeeze(1)
        keys = torch.rand(rest.numel(), generator=gen, device=device)
        add = rest[torch.topk(keys, k - c, sorted=False).indices]
        idx = torch.cat([idx, add]).sort().values
    return idx


# ---------------------------------------------------------------------------------------------------------------
# the codec
# ---------------------------------------------------------------------------------------------------------------


@register("slimdp")
class SlimDPCodec(Codec):
    """Slim-DP core + explorer with key caching. Options: ``alpha`` (0.3), ``eps`` (0.15), ``q`` (core refresh
    period in encodes, 20; 1 = the pure algorithm), ``mode`` (push|pull), ``shared_seed`` (false), ``scope``
    (global|tensor), ``explorer_lane`` (1 = droppable; 0 = reliable), ``seed``, ``rank``, ``block`` (1024)."""

    name = "slimdp"
    capabilities = Capabilities(summable=False, lossy_tolerant=True, stateful_server=True, merges=True,
                                header_part=True, transport_feedback=False)
    """transport_feedback=False: the transport must not fold lost blocks into the next round (its error feedback):
    explorer blocks are (key, value) byte records, and the paper drops what was not delivered."""

    def __init__(
        self,
        alpha: float = 0.3,
        eps: float = 0.15,
        q: int = 20,
        mode: str = "push",
        shared_seed: bool = False,
        scope: str = "global",
        explorer_lane: int = DROPPABLE,
        seed: int = 0,
        rank: int = 0,
        block: int = 1024,
    ) -> None:
        super().__init__()
        if not 0.0 < alpha < 1.0:
            raise ValueError("alpha must be in (0, 1)")
        if not 0.0 <= eps <= alpha:
            raise ValueError("eps must be in [0, alpha]")
        if int(q) < 1:
            raise ValueError("q must be >= 1")
        if mode not in ("push", "pull"):
            raise ValueError("mode must be 'push' or 'pull'")
        if scope not in ("global", "tensor"):
            raise ValueError("scope must be 'global' or 'tensor' (per-tensor selection is a deviation)")
        self.alpha = float(alpha)
        self.eps = float(eps)
        self.q = int(q)
        self.mode = mode
        self.shared_seed = bool(shared_seed)
        self.scope = scope
        self.explorer_lane = int(explorer_lane)
        self.seed = int(seed)
        self.rank = int(rank)
        self.block = int(block)
        self.capabilities = replace(self.capabilities, block=self.block)
        self.last_stats: dict[str, float] = {}

    # -- sizes -------------------------------------------------------------------------------------------------
    def set_sizes(self, n: int) -> tuple[int, int]:
        """(k_core, k_explorer) for a bucket of ``n`` entries: round((alpha - eps) n), round(eps n)."""
        k_exp = int(round(self.eps * n))
        k_core = min(int(round((self.alpha - self.eps) * n)), n - k_exp)
        return k_core, k_exp

    def steady_bytes(self, n: int, element_size: int = 4) -> int:
        """Bytes of a non-refresh message: header + core values + explorer records (or values with shared_seed)."""
        k_core, k_exp = self.set_sizes(n)
        rec = element_size if self.shared_seed else 4 + element_size
        return HEADER_BYTES + k_core * element_size + k_exp * rec

    def refresh_bytes(self, n: int, element_size: int = 4) -> int:
        return self.steady_bytes(n, element_size) + -(-n // 8)

    # -- selection ---------------------------------------------------------------------------------------------
    def _core_mask(self, mag: torch.Tensor, k: int, state: BucketState, gen: torch.Generator) -> torch.Tensor:
        n = mag.numel()
        if self.scope == "global":
            return topk_mask(mag, k, gen)
        sizes = get_segments(state, n)
        parts, off = [], 0
        # per-tensor quota: largest-remainder rounding so the quotas add up to exactly k
        raw = [k * s / n for s in sizes]
        quota = [int(math.floor(r)) for r in raw]
        order = sorted(range(len(sizes)), key=lambda i: raw[i] - quota[i], reverse=True)
        for i in order[: k - sum(quota)]:
            quota[i] += 1
        for s, kk in zip(sizes, quota):
            parts.append(topk_mask(mag[off : off + s], min(kk, s), gen))
            off += s
        return torch.cat(parts)

    # -- encode ------------------------------------------------------------------------------------------------
    def encode(self, bucket: torch.Tensor, state: BucketState) -> list[Part]:
        x = bucket.reshape(-1)
        n = x.numel()
        if n >= 2**31:
            raise ValueError("Slim-DP keys are int32: buckets must hold fewer than 2^31 entries")
        k_core, k_exp = self.set_sizes(n)
        st = state.values
        sel_gen = generator(x.device, self.seed, self.rank, 1, state.step)
        refresh = "tx_core_mask" not in st or state.step - st["tx_refresh_step"] >= self.q
        if refresh:
            mask = self._core_mask(x.abs(), k_core, state, sel_gen)
            st["tx_core_mask"] = mask
            st["tx_core_idx"] = mask.nonzero().squeeze(1)
            st["tx_generation"] = (int(st.get("tx_generation", 0)) + 1) & 0x7FFFFFFF
            st["tx_refresh_step"] = state.step
        core_mask: torch.Tensor = st["tx_core_mask"]
        core_idx: torch.Tensor = st["tx_core_idx"]
        draw_seed = mix_seed(self.seed, self.rank, 2, state.step) & 0x7FFFFFFF
        if self.shared_seed:
            exp_idx = _shared_draw(core_mask, k_exp, draw_seed)
        else:  # the keys travel: draw on the bucket's device (a CPU draw cost 110 of 135 ms per encode on an H100)
            exp_idx = sample_outside(core_mask, k_exp, generator(x.device, draw_seed))
        flags = (VERSION << 8) | (FLAG_REFRESH if refresh else 0) | (FLAG_SHARED_SEED if self.shared_seed else 0)
        header = torch.tensor(
            [flags, st["tx_generation"], draw_seed, k_core, k_exp, n], dtype=torch.int32, device=x.device
        )
        parts = [Part(header, RELIABLE, block_elems=HEADER_INTS, name="header")]
        parts.append(Part(x[core_idx], RELIABLE, block_elems=self.block, name="core"))
        if refresh:
            parts.append(Part(pack_mask(core_mask), RELIABLE, block_elems=self.block, name="core_keys"))
        exp_vals = x[exp_idx]
        if self.shared_seed:
            parts.append(Part(exp_vals, self.explorer_lane, block_elems=self.block, name="explorer"))
        else:
            rec = torch.cat([exp_idx.to(torch.int32).view(-1, 1).view(torch.uint8), _bytes_of(exp_vals)], dim=1)
            rec_bytes = rec.shape[1] if k_exp else 4 + x.element_size()
            parts.append(
                Part(
                    rec.reshape(-1),
                    self.explorer_lane,
                    block_elems=rec_bytes * _EXPLORER_RECORDS_PER_BLOCK,
                    name="explorer",
                )
            )
        state.step += 1
        nbytes = sum(p.nbytes for p in parts)
        self.last_stats = {
            "refresh": float(refresh),
            "bytes": float(nbytes),
            "bytes_per_value": nbytes / max(1, n * x.element_size()),
            "k_core": float(k_core),
            "k_explorer": float(k_exp),
        }
        return parts

    # -- wire geometry -----------------------------------------------------------------------------------------
    def wire_parts(self, header: torch.Tensor, like: torch.Tensor) -> list[Part]:
        """Every part of a message, data on the meta device, from its header part alone.

        A receiver over a transport reads the header first: a refresh round carries one more part (the core keys),
        and the sizes and block geometry of the others follow from k_core, k_explorer and N.
        """
        flags, _, _, k_core, k_exp, n = (int(v) for v in header.reshape(-1).tolist())
        if flags >> 8 != VERSION:
            raise ValueError(f"Slim-DP message version {flags >> 8}, expected {VERSION}")
        dtype = like.dtype
        es = like.element_size()

        def meta(numel: int, dt: torch.dtype) -> torch.Tensor:
            return torch.empty(numel, dtype=dt, device="meta")

        parts = [Part(meta(HEADER_INTS, torch.int32), RELIABLE, HEADER_INTS, "header"),
                 Part(meta(k_core, dtype), RELIABLE, self.block, "core")]
        if flags & FLAG_REFRESH:
            parts.append(Part(meta(-(-n // 8), torch.uint8), RELIABLE, self.block, "core_keys"))
        if flags & FLAG_SHARED_SEED:
            parts.append(Part(meta(k_exp, dtype), self.explorer_lane, self.block, "explorer"))
        else:
            rec = 4 + es
            parts.append(Part(meta(k_exp * rec, torch.uint8), self.explorer_lane, rec * _EXPLORER_RECORDS_PER_BLOCK,
                              "explorer"))
        return parts

    # -- decode ------------------------------------------------------------------------------------------------
    def _read(self, parts: list[Received], state: BucketState, like: torch.Tensor):
        """(core_idx, core_vals, core_ok, exp_idx, exp_vals, exp_ok): the ``*_ok`` masks are None = all arrived."""
        parts = [p.to(like.device) for p in parts]
        flags, generation, draw_seed, k_core, k_exp, n = (int(v) for v in parts[0].data.tolist())
        if flags >> 8 != VERSION:
            raise ValueError(f"Slim-DP message version {flags >> 8}, expected {VERSION}")
        if n != like.numel():
            raise ValueError(f"Slim-DP message is for {n} entries, decoding into {like.numel()}")
        st = state.values
        dtype = like.dtype
        core_vals = parts[1].data.view(dtype) if parts[1].data.dtype != dtype else parts[1].data
        core_ok = element_mask_or_none(parts[1])
        i = 2
        if flags & FLAG_REFRESH:
            mask = unpack_mask(parts[2].data, n)
            st["rx_core_mask"] = mask
            st["rx_core_idx"] = mask.nonzero().squeeze(1)
            st["rx_generation"] = generation
            i = 3
        elif st.get("rx_generation") != generation:
            raise ValueError(
                f"Slim-DP key cache out of sync: message uses core generation {generation}, "
                f"receiver holds {st.get('rx_generation')} (a refresh message was lost or states were mixed up)"
            )
        core_idx = st["rx_core_idx"]
        if core_idx.numel() != k_core:
            raise ValueError("Slim-DP core size does not match the cached keys")
        ex = parts[i]
        if flags & FLAG_SHARED_SEED:
            exp_idx = _shared_draw(st["rx_core_mask"], k_exp, draw_seed)
            exp_vals = ex.data if ex.data.dtype == dtype else ex.data.view(dtype)
            exp_ok = element_mask_or_none(ex)
        else:
            es = torch.empty(0, dtype=dtype).element_size()
            rec = ex.data.view(k_exp, 4 + es) if k_exp else ex.data.view(0, 4 + es)
            exp_idx = rec[:, :4].contiguous().view(torch.int32).view(-1).to(torch.int64)
            exp_vals = rec[:, 4:].contiguous().view(dtype).view(-1)
            m = element_mask_or_none(ex)
            exp_ok = None if m is None else m.view(k_exp, 4 + es)[:, 0]
        return core_idx, core_vals, core_ok, exp_idx, exp_vals, exp_ok

    def _scatter(self, out: torch.Tensor, parts: list[Received], state: BucketState) -> torch.Tensor:
        core_idx, core_vals, core_ok, exp_idx, exp_vals, exp_ok = self._read(parts, state, out)
        if core_ok is None:
            out[core_idx] = core_vals
        else:
            out[core_idx[core_ok]] = core_vals[core_ok]
        if exp_ok is None:
            out[exp_idx] = exp_vals
        else:
            out[exp_idx[exp_ok]] = exp_vals[exp_ok]
        return out

    def decode(self, parts: list[Received], state: BucketState, like: torch.Tensor) -> torch.Tensor:
        """push mode: dense T_C(delta) (zeros elsewhere); pull mode: ``like`` (the local model) merged with the pull."""
        flat_like = like.reshape(-1)
        if self.mode == "pull":
            return self.merge(parts, state, like)
        out = torch.zeros_like(flat_like)
        return self._scatter(out, parts, state).view_as(like)

    def merge(self, parts: list[Received], state: BucketState, local: torch.Tensor) -> torch.Tensor:
        """Pulled coordinates overwrite a copy of ``local``; everything else (and lost explorer blocks) keeps local."""
        out = local.reshape(-1).clone()
        return self._scatter(out, parts, state).view_as(local)


def _bytes_of(v: torch.Tensor) -> torch.Tensor:
    """(k, element_size) uint8 view of a 1-D tensor's bytes."""
    return v.contiguous().view(torch.uint8).view(v.numel(), v.element_size())
