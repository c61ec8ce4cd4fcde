"""Byte formats of LGC payloads: self-describing frames of several tensors, and DEFLATE-coded index sets.

DEFLATE (zlib) runs on the host: index tensors are copied to CPU, delta-coded, compressed, and the bytes are moved back
to the caller's device as a uint8 tensor. Everything else stays on the tensor's device.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

_DTYPES: list[torch.dtype] = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor as a flat uint8 tensor on the same device (no copy when contiguous)."""
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8)


def pack(tensors: list[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """Concatenate 1-D tensors into one uint8 frame: ``count | (dtype, varint nbytes) * count | payloads``.

    The header is a few bytes per tensor and is part of what is sent (and counted).
    """
    if device is None:
        device = tensors[0].device if tensors else "cpu"
    header = bytearray([len(tensors)])
    for t in tensors:
        header.append(_CODE[t.dtype])
        header += _varint(t.numel() * t.element_size())
    head = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    return torch.cat([head] + [as_bytes(t).to(device) for t in tensors])


def unpack(frame: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of :func:`pack`; tensors come back 1-D on the frame's device."""
    frame = frame.reshape(-1)
    n = int(frame[0])
    head = bytes(frame[: 1 + 11 * n].cpu().numpy().tobytes())  # at most 1 + 1 + 10 bytes per entry
    pos = 1
    specs = []
    for _ in range(n):
        code = head[pos]
        pos += 1
        size, pos = _read_varint(head, pos)
        specs.append((_DTYPES[code], size))
    out = []
    for dt, size in specs:
        raw = frame[pos : pos + size]
        pos += size
        if dt == torch.bool:
            out.append(raw.clone().to(torch.bool))
        else:
            out.append(raw.clone().view(dt))
    if pos != frame.numel():
        raise ValueError(f"frame has {frame.numel()} bytes, header describes {pos}")
    return out


# -- index sets -----------------------------------------------------------------------------------------------------
_RAW, _DEFLATE = 0, 1


def encode_indices(idx: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Sorted, distinct non-negative int indices -> uint8 bytes: deltas at the narrowest width, DEFLATE-coded
    (or left raw when DEFLATE would not be shorter). First byte: method (0 raw / 1 deflate) | width code << 1."""
    device = idx.device if device is None else device
    host = idx.detach().to("cpu", torch.int64).numpy()
    deltas = np.diff(host, prepend=0) if host.size else host
    if deltas.size and deltas.min() < 0:
        raise ValueError("indices must be sorted ascending")
    top = int(deltas.max()) if deltas.size else 0
    width = 0 if top < 1 << 8 else 1 if top < 1 << 16 else 2 if top < 1 << 32 else 3
    dt = (np.uint8, np.dtype("<u2"), np.dtype("<u4"), np.dtype("<u8"))[width]
    raw = deltas.astype(dt).tobytes()
    packed = zlib.compress(raw, 9)
    method, body = (_DEFLATE, packed) if len(packed) < len(raw) else (_RAW, raw)
    out = bytearray([method | (width << 1)]) + body
    return torch.frombuffer(out, dtype=torch.uint8).to(device)


def decode_indices(buf: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse of :func:`encode_indices`: int64 indices on ``device`` (default: the buffer's)."""
    device = buf.device if device is None else device
    data = buf.detach().cpu().numpy().tobytes()
    method, width = data[0] & 1, data[0] >> 1
    body = data[1:]
    if method == _DEFLATE:
        body = zlib.decompress(body)
    dt = (np.uint8, np.dtype("<u2"), np.dtype("<u4"), np.dtype("<u8"))[width]
    deltas = np.frombuffer(body, dtype=dt).astype(np.int64)
    return torch.from_numpy(np.cumsum(deltas)).to(device)


_ABSOLUTE, _SET_PERM = 0, 1
_WIDTHS = (np.uint8, np.dtype("<u2"), np.dtype("<u4"), np.dtype("<u8"))


def _width(top: int) -> int:
    return 0 if top < 1 << 8 else 1 if top < 1 << 16 else 2 if top < 1 << 32 else 3


def _maybe_deflate(raw: bytes) -> tuple[int, bytes]:
    packed = zlib.compress(raw, 9)
    return (_DEFLATE, packed) if len(packed) < len(raw) else (_RAW, raw)


def encode_index_list(idx: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Distinct non-negative indices in a meaningful ORDER (LGC sends the AE-layer indices in the order of the values
    the autoencoder sees) -> uint8 bytes, whichever of two layouts is shorter:

    * absolute: the indices as they are at the narrowest width (DEFLATE-coded when that is shorter);
    * set + permutation: the sorted set as :func:`encode_indices`, then each element's rank in that set at the
      narrowest width (DEFLATE-coded when shorter).

    First byte: layout | method << 1 | width << 2; set + permutation then has varint(len of the set bytes).
    On small buckets (indices < 65536) the absolute layout costs what sorted deltas at u16 cost."""
    device = idx.device if device is None else device
    host = idx.detach().to("cpu", torch.int64).numpy()
    if host.size and host.min() < 0:
        raise ValueError("indices must be non-negative")
    width = _width(int(host.max()) if host.size else 0)
    method, body = _maybe_deflate(host.astype(_WIDTHS[width]).tobytes())
    best = bytearray([_ABSOLUTE | (method << 1) | (width << 2)]) + body
    if host.size > 1:
        order = np.argsort(host, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(host.size)
        set_bytes = encode_indices(torch.from_numpy(host[order]), "cpu").numpy().tobytes()
        pwidth = _width(host.size - 1)
        pmethod, pbody = _maybe_deflate(rank.astype(_WIDTHS[pwidth]).tobytes())
        alt = bytearray([_SET_PERM | (pmethod << 1) | (pwidth << 2)]) + _varint(len(set_bytes)) + set_bytes + pbody
        if len(alt) < len(best):
            best = alt
    return torch.frombuffer(best, dtype=torch.uint8).to(device)


def decode_index_list(buf: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse of :func:`encode_index_list`: the int64 indices in their original order."""
    device = buf.device if device is None else device
    data = buf.detach().cpu().numpy().tobytes()
    layout, method, width = data[0] & 1, (data[0] >> 1) & 1, data[0] >> 2
    if layout == _ABSOLUTE:
        body = zlib.decompress(data[1:]) if method == _DEFLATE else data[1:]
        return torch.from_numpy(np.frombuffer(body, dtype=_WIDTHS[width]).astype(np.int64)).to(device)
    n, pos = _read_varint(data, 1)
    sorted_idx = decode_indices(torch.frombuffer(bytearray(data[pos : pos + n]), dtype=torch.uint8), "cpu")
    body = data[pos + n :]
    body = zlib.decompress(body) if method == _DEFLATE else body
    rank = torch.from_numpy(np.frombuffer(body, dtype=_WIDTHS[width]).astype(np.int64))
    return sorted_idx[rank].to(device)


def flatten_module_state(module: torch.nn.Module) -> torch.Tensor:
    """All parameters and buffers of a module as one fp32 vector (for shipping trained AE weights once)."""
    return torch.cat([t.detach().reshape(-1).float() for t in module.state_dict().values()])


def load_module_state(module: torch.nn.Module, flat: torch.Tensor, partial: bool = False) -> torch.Tensor:
    """Load ``module``'s state from the front of ``flat``; returns the values after it (``partial=False``: there
    must be none)."""
    sd = module.state_dict()
    off = 0
    new = {}
    for name, t in sd.items():
        n = t.numel()
        new[name] = flat[off : off + n].view_as(t).to(t.dtype)
        off += n
    if off > flat.numel() or (off != flat.numel() and not partial):
        raise ValueError(f"weights vector has {flat.numel()} values, module expects {off}")
    module.load_state_dict(new)
    return flat[off:]


def entry_overhead(nbytes: int) -> int:
    """Header bytes :func:`pack` spends on one tensor of ``nbytes`` bytes (dtype byte + varint length)."""
    return 1 + len(_varint(nbytes))
