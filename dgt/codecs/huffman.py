"""Canonical, length-limited Huffman coding of integer symbols with vectorised torch encode and decode.

Codebook: Huffman code lengths from the symbol histogram (heap over the alphabet, at most a few thousand symbols;
never a loop over the data), limited to ``MAX_LEN`` = 16 bits by halving the counts until the longest code fits,
then canonical codes (sorted by (length, symbol)), so the receiver rebuilds the code from the lengths alone.

Encode (whole-tensor ops, on the symbols' device): per-symbol code and length by table lookup, bit offsets by a
cumulative sum, and every code OR-ed into a stream of 32-bit words with two ``index_add_`` calls (codes never
overlap, so the sum is the OR); the words are emitted big-endian: an MSB-first bit stream.

Decode: the encoder also records where every ``chunk``-th symbol starts (sync points, 16 bits per chunk), and a
2^16-entry table gives (symbol, length) for every 16-bit window. Pointer jumping (small streams, <= 256 kbit, on CPU;
every stream on CUDA, in lane groups of ~16 Mbit to bound memory): the table entry at every bit position, then symbol
j of a chunk starts at next^j(chunk start), log2(chunk) doubling steps, no loop over symbols, so a few dozen kernel
launches per group. Larger streams on CPU: all chunks side by side, one symbol of every chunk per step, so the Python
loop runs ``chunk`` times (256..4095, see :func:`auto_chunk`) whatever the tensor size, each step a few whole-tensor
ops over ``ceil(n / chunk)`` lanes (on CPU this beats jumping's ~2 log2(chunk) passes over every bit; on a GPU the
loop's 4 launches per step made a 25M-entry decode take 403 ms on an H100).

Message layout (:func:`encode_message`, all uint8): presence bitmap of the alphabet (ceil(A/8) bytes), the lengths of
the present symbols minus one as 4-bit nibbles (ceil(present/2) bytes), the bit length of every chunk but the last
(uint16 little-endian, 2 bytes each), then the stream (ceil(total_bits/8) bytes). The alphabet size, the symbol count
and the chunk size travel in the enclosing codec's header. Host transfers: the histogram (A integers) and the few
codebook bytes go to the host to build/read the code; the data itself never leaves its device.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_LEN = 16
DEFAULT_CHUNK = 256
_PRECOMPUTE_BITS = 1 << 22  # streams up to 4 Mbit decode from a per-bit-position table (16 MiB of int32)
_JUMP_BITS = 1 << 18  # streams up to 256 kbit decode by pointer jumping over that table (any size on CUDA)
_JUMP_GROUP_BITS = 1 << 24  # pointer jumping works on lane groups of about 16 Mbit: 4 x 64 MiB of int32 tables


# ---------------------------------------------------------------------------------------------------------------
# codebook
# ---------------------------------------------------------------------------------------------------------------


def _huffman_lengths(counts: np.ndarray) -> np.ndarray:
    """Unlimited Huffman code lengths (0 for absent symbols; a lone symbol gets length 1).

    Moffat and Katajainen's in-place method over the sorted weights: three linear sweeps over the alphabet (a loop
    over at most 2^16 symbol kinds, never over the data)."""
    alphabet = counts.shape[0]
    lengths = np.zeros(alphabet, dtype=np.int64)
    used = np.flatnonzero(counts > 0)
    n = used.size
    if n == 0:
        return lengths
    if n == 1:
        lengths[used[0]] = 1
        return lengths
    order = used[np.argsort(counts[used], kind="stable")]
    w = counts[order].tolist()
    # pass 1: combine, left to right; w[i] becomes the parent index of internal node i
    w[0] += w[1]
    root, leaf = 0, 2
    for nxt in range(1, n - 1):
        if leaf >= n or w[root] < w[leaf]:
            w[nxt] = w[root]
            w[root] = nxt
            root += 1
        else:
            w[nxt] = w[leaf]
            leaf += 1
        if leaf >= n or (root < nxt and w[root] < w[leaf]):
            w[nxt] += w[root]
            w[root] = nxt
            root += 1
        else:
            w[nxt] += w[leaf]
            leaf += 1
    # pass 2: depths of internal nodes, right to left
    w[n - 2] = 0
    for nxt in range(n - 3, -1, -1):
        w[nxt] = w[w[nxt]] + 1
    # pass 3: leaf depths
    avail, used_nodes, depth = 1, 0, 0
    root, nxt = n - 2, n - 1
    while avail > 0:
        while root >= 0 and w[root] == depth:
            used_nodes += 1
            root -= 1
        while avail > used_nodes:
            w[nxt] = depth
            nxt -= 1
            avail -= 1
        avail = 2 * used_nodes
        depth += 1
        used_nodes = 0
    lengths[order] = np.asarray(w, dtype=np.int64)
    return lengths


def code_lengths(counts: np.ndarray | torch.Tensor, max_len: int = MAX_LEN) -> np.ndarray:
    """Length-limited Huffman code lengths for a histogram (halve the counts until the longest code fits)."""
    c = np.asarray(counts.cpu() if isinstance(counts, torch.Tensor) else counts, dtype=np.int64).copy()
    if c.ndim != 1:
        raise ValueError("counts must be 1-D")
    if np.count_nonzero(c) > (1 << max_len):
        raise ValueError(f"{np.count_nonzero(c)} symbols cannot be coded in {max_len} bits")
    while True:
        lengths = _huffman_lengths(c)
        if lengths.max(initial=0) <= max_len:
            return lengths
        c = np.where(c > 0, (c + 1) // 2, 0)


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical code values (MSB-first) for given lengths: codes ascend in (length, symbol) order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = np.zeros_like(lengths)
    used = np.flatnonzero(lengths > 0)
    if used.size == 0:
        return codes
    order = used[np.lexsort((used, lengths[used]))]
    ls = lengths[order]
    max_len = int(ls.max())
    bl_count = np.bincount(ls, minlength=max_len + 1)
    bl_count[0] = 0
    next_code = np.zeros(max_len + 2, dtype=np.int64)
    code = 0
    for bits in range(1, max_len + 1):  # DEFLATE's first-code-per-length recurrence (<= 16 steps)
        code = (code + bl_count[bits - 1]) << 1
        next_code[bits] = code
    first_pos = np.searchsorted(ls, ls, side="left")
    rank = np.arange(order.size) - first_pos
    codes[order] = next_code[ls] + rank
    if np.any(codes[order] >> ls):
        raise ValueError("code lengths violate the Kraft inequality")
    return codes


def kraft_ok(lengths: np.ndarray) -> bool:
    ls = np.asarray(lengths)[np.asarray(lengths) > 0]
    return float(np.sum(2.0 ** (-ls.astype(np.float64)))) <= 1.0 + 1e-12


def decode_table(lengths: np.ndarray, codes: np.ndarray, device: torch.device) -> torch.Tensor:
    """int32 table over all 16-bit windows: (symbol << 8) | length of the code that prefixes the window."""
    lengths = np.asarray(lengths, dtype=np.int64)
    used = np.flatnonzero(lengths > 0)
    table = np.zeros(1 << MAX_LEN, dtype=np.int64)
    if used.size:
        order = used[np.lexsort((used, lengths[used]))]
        spans = 1 << (MAX_LEN - lengths[order])
        vals = (order << 8) | lengths[order]
        filled = np.repeat(vals, spans)
        start = int(codes[order[0]]) << (MAX_LEN - int(lengths[order[0]]))  # 0 for canonical codes
        table[start : start + filled.size] = filled
    return torch.from_numpy(table.astype(np.int32)).to(device)


# ---------------------------------------------------------------------------------------------------------------
# bit stream
# ---------------------------------------------------------------------------------------------------------------


def auto_chunk(n: int) -> int:
    """Symbols per sync point: 256 for small tensors, growing so that at most ~4096 chunks decode side by side
    (more lanes than that thrash the cache: every lane reads its own part of the stream)."""
    return int(min(4095, max(DEFAULT_CHUNK, -(-n // 4096))))


def _shifted_tables(lengths: np.ndarray, codes: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For every start bit s in 0..15 and symbol: the code's share of its first 16-bit word and of the next one."""
    a = lengths.shape[0]
    ln = np.asarray(lengths, dtype=np.int64)[None, :]
    cw = np.asarray(codes, dtype=np.int64)[None, :]
    s = np.arange(16, dtype=np.int64)[:, None]
    e = s + ln  # end bit counted from the start of the first word, <= 15 + 16
    hi = np.where(e <= 16, cw << np.clip(16 - e, 0, None), cw >> np.clip(e - 16, 0, None))
    spill = np.clip(e - 16, 0, None)
    lo = np.where(e > 16, (cw & ((1 << spill) - 1)) << np.clip(32 - e, 0, 16), 0)
    to = lambda t: torch.from_numpy(t.reshape(16 * a).astype(np.int32)).to(device)
    return to(hi), to(lo)


def encode_symbols(
    symbols: torch.Tensor,
    lengths: np.ndarray,
    codes: np.ndarray,
    chunk: int = DEFAULT_CHUNK,
    counts: np.ndarray | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(stream uint8 of ceil(bits/8) bytes, bit length of every chunk of ``chunk`` symbols as int64).

    ``counts`` (the symbol histogram the code was built from) saves a pass; it is recomputed when absent."""
    device = symbols.device
    sym = symbols.reshape(-1)
    n = sym.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.uint8, device=device), torch.zeros(0, dtype=torch.int64, device=device)
    lengths = np.asarray(lengths, dtype=np.int64)
    a = lengths.shape[0]
    sym = sym.to(torch.int64)
    if counts is None:
        counts = torch.bincount(sym, minlength=a).cpu().numpy()
    if counts.shape[0] > a or np.any((np.asarray(counts)[:a] > 0) & (lengths == 0)):
        raise ValueError("a symbol has no code (outside the alphabet, or its count was zero when the code was built)")
    total = int(np.dot(np.asarray(counts, dtype=np.int64), lengths))
    ln = torch.index_select(torch.from_numpy(lengths.astype(np.int32)).to(device), 0, sym)
    idt = torch.int32 if total < 2**31 - 64 else torch.int64
    end = torch.cumsum(ln, 0, dtype=idt)
    off = end - ln
    t_hi, t_lo = _shifted_tables(lengths, codes, device)
    key = (off & 15).to(torch.int64).mul_(a).add_(sym)
    word = off >> 4
    nwords = (total + 15) // 16 + 1
    words = torch.zeros(nwords, dtype=torch.int32, device=device)
    words.index_add_(0, word, torch.index_select(t_hi, 0, key))
    words.index_add_(0, word + 1, torch.index_select(t_lo, 0, key))
    stream = torch.stack([(words >> 8) & 0xFF, words & 0xFF], dim=1).to(torch.uint8).view(-1)[: (total + 7) // 8]
    ends = torch.arange(chunk - 1, max(n, chunk - 1), chunk, device=device)
    if n % chunk:
        ends = torch.cat([ends, ends.new_full((1,), n - 1)])
    chunk_bits = torch.diff(end[ends].to(torch.int64), prepend=torch.zeros(1, dtype=torch.int64, device=device))
    return stream, chunk_bits


def _entries(win: torch.Tensor, table: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The table entry at every bit position in [lo, hi) (a code may start anywhere)."""
    pos = torch.arange(lo, hi, dtype=torch.int64 if hi >= 2**31 else torch.int32, device=win.device)
    w = torch.index_select(win, 0, pos >> 3)
    return torch.index_select(table, 0, (w >> (8 - (pos & 7))) & 0xFFFF)


def _jump_lanes(
    win: torch.Tensor, table: torch.Tensor, starts: torch.Tensor, steps: int, lo: int, hi: int
) -> torch.Tensor:
    """Table entries of ``steps`` symbols for lanes whose codes all lie in bits [lo, hi): (steps, lanes) int32.

    The table entry at every bit position of the span once (a code may start anywhere), then pointer jumping:
    nxt[p] = where the code after the one at p starts, and symbol j of a lane starts at nxt^j(lane start). Doubling
    gives rows [2^k, 2^(k+1)) from rows [0, 2^k): log2(steps) steps, no loop over symbols at all. Positions past the
    span clamp to its end; only a lane's symbols past the message's last one ever land there, and they are cut."""
    nb = hi - lo
    at = _entries(win, table, lo, hi)
    nxt = (torch.arange(nb, dtype=torch.int32, device=win.device) + (at & 0xFF)).clamp_(max=nb - 1)
    rows = (starts - lo).to(torch.int32)  # row-major (step, lane), grown by doubling
    have = 1
    while have < steps:
        rows = torch.cat([rows, torch.index_select(nxt, 0, rows)])
        have *= 2
        if have < steps:
            nxt = torch.index_select(nxt, 0, nxt)
    return torch.index_select(at, 0, rows[: steps * starts.numel()]).view(steps, starts.numel())


def _decode_by_jumping(
    win: torch.Tensor, table: torch.Tensor, starts: torch.Tensor, steps: int, nbits: int, group_bits: int
) -> torch.Tensor:
    """:func:`_jump_lanes` over groups of lanes spanning about ``group_bits`` each, so the per-bit tables stay
    bounded (4 int32 per bit of the group) whatever the stream size: a handful of launches per group instead of
    ``steps`` loop iterations (what decides the time on a GPU, where every op is a kernel launch)."""
    lanes = starts.numel()
    if nbits <= group_bits:
        return _jump_lanes(win, table, starts, steps, 0, nbits)
    s = starts.cpu().numpy()
    cut = np.searchsorted(s, np.arange(group_bits, int(s[-1]) + 1, group_bits), side="left").tolist()
    bounds = [0] + [c for c in cut if 0 < c < lanes] + [lanes]
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if a == b:
            continue
        hi = int(s[b]) if b < lanes else nbits
        out.append(_jump_lanes(win, table, starts[a:b], steps, int(s[a]), hi))
    return torch.cat(out, dim=1)


def decode_symbols(
    stream: torch.Tensor,
    lengths: np.ndarray,
    codes: np.ndarray,
    n: int,
    chunk_bits: torch.Tensor,
    chunk: int,
    jump: bool | None = None,
) -> torch.Tensor:
    """Decode ``n`` symbols; ``chunk_bits`` = bit length of each chunk (the last may be absent).

    ``jump`` picks pointer jumping over lane groups (default: on CUDA, or for streams up to ``_JUMP_BITS``) over the
    loop of one symbol per lane per step (default on CPU, where jumping's ~log2(chunk) passes over every bit cost
    more than the loop's ``chunk`` small steps)."""
    device = stream.device
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    table = decode_table(lengths, codes, device)
    lanes = -(-n // chunk)
    idt = torch.int32 if stream.numel() < 2**27 else torch.int64
    starts = torch.zeros(lanes, dtype=torch.int64, device=device)
    if lanes > 1:
        starts[1:] = torch.cumsum(chunk_bits[: lanes - 1].to(device=device, dtype=torch.int64), 0)
    steps = min(chunk, n)
    # 24-bit window starting at every byte (zero padded: the last lane may run past its last symbol)
    pad = 2 * steps + 8
    s = torch.cat([stream.reshape(-1).to(torch.int32), torch.zeros(pad, dtype=torch.int32, device=device)])
    win = (s[:-2] << 16) | (s[1:-1] << 8) | s[2:]
    nbits = 8 * stream.numel() + 16 * steps + 16
    if jump is None:
        jump = device.type == "cuda" or nbits <= _JUMP_BITS
    if jump:
        sym = _decode_by_jumping(win, table, starts, steps, nbits, _JUMP_GROUP_BITS)
        return (sym.T.reshape(-1)[:n] >> 8).to(torch.int64)
    out = torch.empty(steps, lanes, dtype=torch.int32, device=device)
    p = starts.to(idt)
    if nbits <= _PRECOMPUTE_BITS:
        at = _entries(win, table, 0, nbits)  # medium streams: every position once, then one lookup per symbol
        for j in range(steps):  # one symbol of every chunk per step: ``chunk`` iterations whatever n is
            entry = torch.index_select(at, 0, p)
            out[j] = entry
            p += entry & 0xFF
    else:
        for j in range(steps):
            w = torch.index_select(win, 0, p >> 3)
            entry = torch.index_select(table, 0, (w >> (8 - (p & 7))) & 0xFFFF)
            out[j] = entry
            p += entry & 0xFF
    return (out.T.reshape(-1)[:n] >> 8).to(torch.int64)


# ---------------------------------------------------------------------------------------------------------------
# self-contained messages
# ---------------------------------------------------------------------------------------------------------------


def pack_lengths(lengths: np.ndarray) -> bytes:
    """Presence bitmap (LSB first) + 4-bit (length - 1) per present symbol."""
    lengths = np.asarray(lengths, dtype=np.int64)
    present = lengths > 0
    bitmap = np.packbits(present.astype(np.uint8), bitorder="little")
    nib = (lengths[present] - 1).astype(np.uint8)
    if nib.size % 2:
        nib = np.concatenate([nib, np.zeros(1, dtype=np.uint8)])
    packed = nib[0::2] | (nib[1::2] << 4)
    return bitmap.tobytes() + packed.astype(np.uint8).tobytes()


def unpack_lengths(buf: np.ndarray, alphabet: int) -> tuple[np.ndarray, int]:
    """(lengths, bytes consumed) from the head of ``buf`` (uint8 numpy)."""
    nb = -(-alphabet // 8)
    present = np.unpackbits(buf[:nb], bitorder="little")[:alphabet].astype(bool)
    cnt = int(present.sum())
    nn = -(-cnt // 2)
    packed = buf[nb : nb + nn]
    nib = np.empty(2 * nn, dtype=np.int64)
    nib[0::2] = packed & 0xF
    nib[1::2] = packed >> 4
    lengths = np.zeros(alphabet, dtype=np.int64)
    lengths[present] = nib[:cnt] + 1
    return lengths, nb + nn


def codebook_nbytes(alphabet: int, present: int) -> int:
    return -(-alphabet // 8) + -(-present // 2)


def encode_message(
    symbols: torch.Tensor, alphabet: int, chunk: int = DEFAULT_CHUNK, stats: dict | None = None
) -> torch.Tensor:
    """Symbols in [0, alphabet) -> one uint8 tensor: codebook + sync points + stream (layout in the module doc).

    ``stats``, when given, receives the byte count of each section (codebook, sync, stream)."""
    if not 1 <= chunk <= 4095:
        raise ValueError("chunk must be in 1..4095 (chunk bit lengths travel as uint16)")
    device = symbols.device
    sym = symbols.reshape(-1).to(torch.int64)
    counts = torch.bincount(sym, minlength=alphabet).cpu().numpy() if sym.numel() else np.zeros(alphabet, np.int64)
    if counts.shape[0] > alphabet:
        raise ValueError("symbol outside the alphabet")
    lengths = code_lengths(counts)
    codes = canonical_codes(lengths)
    stream, chunk_bits = encode_symbols(sym, lengths, codes, chunk, counts)
    book = torch.from_numpy(np.frombuffer(pack_lengths(lengths), dtype=np.uint8).copy()).to(device)
    cb = chunk_bits[:-1]
    sync_bytes = torch.stack([cb & 0xFF, cb >> 8], dim=1).to(torch.uint8).view(-1)  # uint16 little-endian
    if stats is not None:
        stats.update(codebook=book.numel(), sync=sync_bytes.numel(), stream=stream.numel())
    return torch.cat([book, sync_bytes, stream])


def decode_message(buf: torch.Tensor, alphabet: int, n: int, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Inverse of :func:`encode_message` (``alphabet``, ``n`` and ``chunk`` come from the enclosing header)."""
    device = buf.device
    head_max = codebook_nbytes(alphabet, alphabet)
    head = buf[:head_max].cpu().numpy()
    lengths, used = unpack_lengths(head, alphabet)
    codes = canonical_codes(lengths)
    lanes = -(-n // chunk) if n else 0
    nsync = max(0, lanes - 1)
    sb = buf[used : used + 2 * nsync].to(torch.int64).view(-1, 2)
    sync = sb[:, 0] | (sb[:, 1] << 8)
    stream = buf[used + 2 * nsync :]
    return decode_symbols(stream, lengths, codes, n, sync, chunk).to(device)
