"""Session control messages on the reliable lane: CONTROL frames with a small JSON payload (hello, welcome, ping,
bye). The header's session token authenticates the session; a wrong token fails header validation."""

from __future__ import annotations

import json
from typing import Any

from dgt import wire
from dgt.errors import ProtocolError
from dgt.wire import FrameType

HELLO = "hello"  # dialer -> acceptor: rank, address, lanes
WELCOME = "welcome"  # acceptor -> dialer: accepted
CHALLENGE = "challenge"  # acceptor -> dialer: its nonce and its proof (dgt.transport.auth)
AUTH = "auth"  # dialer -> acceptor: the dialer's proof
REFUSE = "refuse"  # acceptor -> dialer: why not
PING = "ping"
BYE = "bye"  # the sender is closing its endpoint on purpose
ABORT = "abort"  # the sender's collective failed for a reason every rank must see (a RankMismatch): ``why``
STALE = "stale"  # receiver -> sender: that round is ignored (key closed already, or refused by the limits)
LOST = "lost"  # the sender's collective failed on a failed peer (``why``): calls waiting on the sender fail now
REFUSED = "refused"  # the sender refused its input to one call (``family``, ``bucket``, ``round``) before any traffic:
# ``why``; a peer inside that very call fails with RankMismatch, a peer that refused it too ignores it (issue 45)
ON_LINK = "on-link"  # (i22) the sender runs ``bucket``/``round`` on the session link (rounds), not on stream lanes


def control(token: int, rank: int, op: str, **fields: Any) -> bytes:
    payload = json.dumps({"op": op, **fields}, separators=(",", ":")).encode()
    return wire.encode_frame(FrameType.CONTROL, payload, token=token, rank=rank)


def parse(frame: memoryview | bytes | None, limits: wire.Limits = wire.DEFAULT_LIMITS) -> tuple[int, dict[str, Any]]:
    """(sender rank, message) of one CONTROL frame; ProtocolError if it is anything else (None: a frame whose bytes
    the reader did not keep)."""
    if frame is None:
        raise ProtocolError("expected a CONTROL frame, got a frame without its bytes")
    h = wire.decode_header(frame[: wire.HEADER_SIZE], limits)
    if int(h["ftype"]) != FrameType.CONTROL:
        raise ProtocolError(f"expected a CONTROL frame, got frame type {int(h['ftype'])}")
    try:
        msg = json.loads(bytes(frame[wire.HEADER_SIZE :]))
    except ValueError as exc:
        raise ProtocolError(f"CONTROL payload is not JSON: {exc}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError("CONTROL payload must be an object with an 'op'")
    return int(h["rank"]), msg
