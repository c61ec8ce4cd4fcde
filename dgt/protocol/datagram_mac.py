"""Sans-IO MAC for datagrams: a Wegman-Carter tag computed for a whole batch (or a whole round) at once.

tag(M) = (NH_K(pad_L(M)) + P(sender, receiver, bucket, round, slot)) mod 2^64, sent as an 8-byte little-endian
trailer after the payload (``Flags.MAC`` in the header says it is there). ``M`` is the 48-byte header (with
``Flags.MAC`` set) followed by the payload; ``pad_L`` zero-pads it to ``MESSAGE_MAX`` bytes, so every message is
hashed at one length (NH's bound holds for equal-length strings). The header holds the payload length, so ``pad_L``
is injective on well-formed datagrams. The padding is not hashed word by word: its pairs contribute a key-only
constant per message length, kept in a table (``_tail``).

- ``NH`` is UMAC's first-layer hash with 32-bit words (Black, Halevi, Krawczyk, Krovetz, Rogaway, "UMAC: Fast and
  Secure Message Authentication", CRYPTO '99, full version; RFC 4418 section 5.1): sum of
  ((m_2i + k_2i) mod 2^32) * ((m_2i+1 + k_2i+1) mod 2^32) mod 2^64. It is 2^-32-almost-Delta-universal for
  subtraction mod 2^64 on equal-length strings (ibid.), which is what an additive pad needs (a XOR pad would not be
  covered by that result).
- The pad ``P`` is a pseudo-random function of the nonce: SHAKE256(pad key || sender, receiver, bucket, round), read
  as 8-byte words, word ``slot`` for the fragment in slot ``block * frags_per_block + fragment index`` of its round.
  One SHAKE call draws the pads of a whole round. A nonce is never used for two different messages as long as a
  sender never sends two different payloads for the same (receiver, bucket, round, fragment), which the transport
  does not (a round is planned once).
- Keys: ``K`` (NH, ``MESSAGE_MAX`` bytes) and the pad key come from the session key (HMAC(secret, token), see
  dgt/transport/auth.py) through SHAKE256 with distinct labels.

Forgery bound (Wegman-Carter with an AΔU hash and a PRF pad): each forged datagram is accepted with probability at
most 2^-32 plus the PRF's distinguishing advantage, whatever genuine datagrams the attacker saw; q forged datagrams
succeed with probability at most q * 2^-32 (+ the PRF term). Every refused datagram is counted (``bad-mac``).

NH runs in C when the optional extension ``dgt.protocol._nh`` is built (setup.py), else in numpy
(:func:`nh_rows_numpy`); both give identical results (tests/test_datagram_mac.py).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import numpy as np

from dgt import wire

_nh: Any
try:
    from dgt.protocol import _nh  # type: ignore[attr-defined, no-redef]  # optional C extension, no stubs
except ImportError:  # no C compiler at install: the numpy twin
    _nh = None

TAG = wire.MAC_TAG  # trailer bytes
MESSAGE_MAX = wire.HEADER_SIZE + (1 << 16)  # every message is hashed as if zero-padded to this many bytes
_PAIRS = MESSAGE_MAX // 8
_NONCE = struct.Struct(">IIII")  # sender, receiver, bucket, round
_CHUNK = 4096  # rows per numpy pass (keeps the temporaries in cache)


def nh_rows_numpy(data: np.ndarray, starts: np.ndarray, nbytes: int, key: np.ndarray) -> np.ndarray:
    """NH of every row ``data[s : s + nbytes]`` (uint8 ``data``), zero-padded to a multiple of 8 bytes: uint64."""
    starts = np.asarray(starts, np.int64)
    out = np.empty(len(starts), np.uint64)
    if len(starts) == 0:
        return out
    if int(starts.min()) < 0 or int(starts.max()) + nbytes > len(data):
        raise ValueError("nh: a row reaches outside the data")
    n8 = -(-nbytes // 8) * 8
    k = key[: n8 // 4]
    rows = np.lib.stride_tricks.as_strided(data, shape=(max(len(data) - nbytes + 1, 1), nbytes), strides=(1, 1))
    buf = np.zeros((min(len(starts), _CHUNK), n8), np.uint8)
    for a in range(0, len(starts), _CHUNK):
        s = starts[a : a + _CHUNK]
        b = buf[: len(s)]
        b[:, :nbytes] = rows[s]
        w = b.view("<u4") + k  # uint32 wraps: (m + k) mod 2^32
        out[a : a + len(s)] = np.multiply(w[:, 0::2], w[:, 1::2], dtype=np.uint64).sum(axis=1, dtype=np.uint64)
    return out


def nh_rows(data: np.ndarray, starts: np.ndarray, nbytes: int, key: np.ndarray, native: bool = True) -> np.ndarray:
    """:func:`nh_rows_numpy`, in C when the extension is built (and ``native``)."""
    if _nh is None or not native:
        return nh_rows_numpy(data, starts, nbytes, key)
    starts = np.ascontiguousarray(starts, np.int64)
    out = np.empty(len(starts), np.uint64)
    if len(starts):
        _nh.nh(data, starts, nbytes, key, out)
    return out


class DatagramMac:
    """The session's datagram MAC: keys derived from the session key; tags for a round's datagrams (sender side)
    and verification of a batch (receiver side), vectorised, never a Python call per datagram."""

    def __init__(self, session_key: bytes, native: bool = True) -> None:
        if len(session_key) < 16:
            raise ValueError("the session key is too short for a MAC key")
        self.native = native
        self.key = np.frombuffer(hashlib.shake_256(b"dgt-datagram-mac:nh|" + session_key).digest(MESSAGE_MAX),
                                 "<u4").astype(np.uint32)
        self._pad_key = hashlib.sha256(b"dgt-datagram-mac:pad|" + session_key).digest()
        k = self.key.astype(np.uint64)
        terms = k[0::2] * k[1::2]  # a pair of zero words hashes to k_2i * k_2i+1
        tail = np.zeros(_PAIRS + 1, np.uint64)
        tail[:-1] = np.cumsum(terms[::-1], dtype=np.uint64)[::-1]  # wraps mod 2^64, as NH does
        self._tail = tail  # _tail[j]: the padding pairs j.._PAIRS-1 of a message of j pairs

    @property
    def tail(self) -> np.ndarray:
        """``tail[j]``: NH of the zero padding after a message of ``j`` word pairs (uint64, read-only use)."""
        return self._tail

    # -- building blocks
    def pads(self, sender: int, receiver: int, bucket: int, round: int, n: int) -> np.ndarray:
        """The pads of slots 0..n-1 of one round (one SHAKE call)."""
        seed = self._pad_key + _NONCE.pack(sender & 0xFFFFFFFF, receiver & 0xFFFFFFFF, bucket, round)
        return np.frombuffer(hashlib.shake_256(seed).digest(8 * n), "<u8").astype(np.uint64)

    def hash(self, headers: np.ndarray, data: np.ndarray, starts: np.ndarray, nbytes: int) -> np.ndarray:
        """NH of ``pad_L(header_i || data[starts_i : +nbytes])`` for every row: ``headers`` is ``[k, 48]`` uint8
        (the header occupies the first 6 word pairs exactly, so the payload hashes on with the key from word 12)."""
        if nbytes + wire.HEADER_SIZE > MESSAGE_MAX:
            raise ValueError(f"a datagram payload of {nbytes} bytes exceeds the MAC's {MESSAGE_MAX - 48}")
        w = np.ascontiguousarray(headers).view("<u4") + self.key[:12]
        h = np.multiply(w[:, 0::2], w[:, 1::2], dtype=np.uint64).sum(axis=1, dtype=np.uint64)
        h += nh_rows(data, starts, nbytes, self.key[12:], self.native)
        h += self._tail[6 + -(-nbytes // 8)]
        return np.asarray(h, np.uint64)

    def hash_packed(self, data: np.ndarray, starts: np.ndarray, nbytes: int) -> np.ndarray:
        """NH of ``pad_L(data[s : s + nbytes])`` for datagrams laid out whole (header then payload) in ``data``."""
        h = nh_rows(data, starts, nbytes, self.key, self.native)
        h += self._tail[-(-nbytes // 8)]
        return h

    # -- sender
    def tags(self, headers: np.ndarray, raw: np.ndarray, offsets: np.ndarray, nbytes: int,
             pads: np.ndarray) -> np.ndarray:
        """Tags of datagrams ``headers[i] || raw[offsets[i] : +nbytes]`` (uint64, pads already picked per row)."""
        return np.asarray(self.hash(headers, raw, offsets, nbytes) + pads, np.uint64)

    def tag_rows(self, rows: np.ndarray, nbytes: int, pads: np.ndarray) -> None:
        """Write the tag of each packed datagram ``rows[i, :nbytes]`` (header and payload) into ``rows[i, nbytes:
        nbytes + TAG]``: one C call per batch (the rows are in cache, just packed)."""
        k, seg = rows.shape
        if k == 0:
            return
        starts = np.arange(0, k * seg, seg, dtype=np.int64)
        flat = rows.reshape(-1)
        if _nh is not None and self.native and rows.flags.c_contiguous:
            _nh.tags(flat, starts, nbytes, self.key, int(self._tail[-(-nbytes // 8)]), np.ascontiguousarray(pads,
                     np.uint64), True)
            return
        h = self.hash_packed(np.ascontiguousarray(flat), starts, nbytes) + pads
        rows[:, nbytes : nbytes + TAG] = tag_bytes(h)

    # -- receiver
    def verify(self, data: np.ndarray, starts: np.ndarray, nbytes: int, pads: np.ndarray) -> np.ndarray:
        """Per datagram ``data[s : s + nbytes + TAG]`` (header, payload, tag): whether its tag is right."""
        if _nh is not None and self.native:
            ok = _nh.tags(data, np.ascontiguousarray(starts, np.int64), nbytes, self.key,
                          int(self._tail[-(-nbytes // 8)]), np.ascontiguousarray(pads, np.uint64), False)
            return np.frombuffer(ok, np.bool_).copy()
        h = self.hash_packed(data, starts, nbytes) + pads
        tag_rows = np.lib.stride_tricks.as_strided(data, shape=(max(len(data) - TAG + 1, 1), TAG), strides=(1, 1))
        got = np.ascontiguousarray(tag_rows[np.asarray(starts, np.int64) + nbytes]).view("<u8").reshape(-1)
        return np.asarray(got == h, np.bool_)

    def check_fragments(self, h: np.ndarray, src: np.ndarray, pos: np.ndarray, round_pads: np.ndarray,
                        block: np.ndarray, frag_index: np.ndarray, count: np.ndarray, frag: int, itemsize: int,
                        frags_per_block: int) -> np.ndarray:
        """Per fragment of a batch (headers ``h``, payloads at ``pos`` in ``src``, each checked already against
        its round's geometry: ``block``, ``frag_index``, element ``count``): whether it has ``Flags.MAC`` and a
        right trailer. One NH pass over the full-size fragments, one per odd-size tail (a few per round)."""
        ok = (h["flags"] & wire.Flags.MAC) != 0
        pads = round_pads[slots(block, frag_index, frags_per_block)]
        starts = pos - wire.HEADER_SIZE
        full = count == frag
        idx = np.flatnonzero(full & ok)
        if len(idx):
            ok[idx] = self.verify(src, starts[idx], wire.HEADER_SIZE + frag * itemsize, pads[idx])
        for i in np.flatnonzero(~full & ok).tolist():
            nbytes = wire.HEADER_SIZE + int(count[i]) * itemsize
            ok[i] = bool(self.verify(src, starts[i : i + 1], nbytes, pads[i : i + 1])[0])
        return np.asarray(ok, np.bool_)


def slots(block: np.ndarray, frag_index: np.ndarray, frags_per_block: int) -> np.ndarray:
    """A fragment's pad slot in its round: ``block * frags_per_block + fragment index``."""
    return block.astype(np.int64) * frags_per_block + frag_index.astype(np.int64)


def tag_bytes(tags: np.ndarray) -> np.ndarray:
    """Tags as ``[k, TAG]`` uint8 rows (little-endian)."""
    return np.ascontiguousarray(tags, "<u8").view(np.uint8).reshape(-1, TAG)
