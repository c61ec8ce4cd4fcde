"""Authenticated membership: every connection to an endpoint (the session link and each stream lane) proves
knowledge of the session key by an HMAC-SHA256 challenge-response, bound to the session token, both ranks, the
connection's purpose and fresh nonces from both ends. Sans-IO: the endpoint moves the four messages
(HELLO + nonce, CHALLENGE + nonce + acceptor proof, AUTH + dialer proof, WELCOME/REFUSE).

The key comes from the user (``TransportConfig.secret``, ``DGT_SECRET``, or the file named by ``DGT_SECRET_FILE``);
without one it is derived from the session token, which the c10d store hands out: the store is then the trust
boundary (see docs/security.md)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from typing import Any

NONCE_BYTES = 16
_log = logging.getLogger("dgt.auth")
_noted = False


def user_secret(explicit: bytes | str | None = None) -> bytes | None:
    """The user's secret: ``explicit``, else ``DGT_SECRET``, else the contents of ``DGT_SECRET_FILE``; None if none.
    An empty secret is an error (it would look like protection and be none)."""
    if explicit is None:
        explicit = os.environ.get("DGT_SECRET")
    if explicit is None and os.environ.get("DGT_SECRET_FILE"):
        path = os.environ["DGT_SECRET_FILE"]
        try:
            with open(path, "rb") as f:
                explicit = f.read().strip()
        except OSError as exc:
            raise ValueError(f"DGT_SECRET_FILE={path!r} cannot be read: {exc}") from None
    if explicit is None:
        return None
    raw = explicit.encode() if isinstance(explicit, str) else bytes(explicit)
    if not raw:
        raise ValueError("the session secret is empty")
    return raw


def session_key(token: int, secret: bytes | None) -> bytes:
    """The key every proof of this session uses: HMAC(secret, token). Without a user secret, derived from the
    token alone (anyone who can read the c10d store can then join; noted once per process)."""
    global _noted
    if secret is None:
        if not _noted:
            _noted = True
            _log.warning("dgt: no DGT_SECRET/DGT_SECRET_FILE: the session key is derived from the session token, so "
                         "the c10d store is the trust boundary (anyone who can read it can join the session)")
        secret = b"dgt-derived-from-token"
    return hmac.new(secret, b"dgt-session:" + int(token).to_bytes(8, "big"), hashlib.sha256).digest()


def nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def proof(key: bytes, role: str, prover: int, verifier: int, dialer_nonce: str, acceptor_nonce: str,
          purpose: str) -> str:
    """The MAC a party (``role`` "dialer" or "acceptor", rank ``prover``) shows to rank ``verifier`` for one
    connection: bound to both ranks, both nonces and what the connection is for (the session link or a stream lane
    direction), so a proof is good for nothing else."""
    msg = "|".join((role, str(int(prover)), str(int(verifier)), str(dialer_nonce), str(acceptor_nonce), purpose))
    return hmac.new(key, msg.encode(), hashlib.sha256).hexdigest()


def verify(key: bytes, shown: object, role: str, prover: int, verifier: int, dialer_nonce: str,
           acceptor_nonce: str, purpose: str) -> bool:
    """Whether ``shown`` is the right proof (constant-time compare; anything not a string is wrong)."""
    if not isinstance(shown, str) or not isinstance(dialer_nonce, str) or len(dialer_nonce) != 2 * NONCE_BYTES:
        return False
    want = proof(key, role, prover, verifier, dialer_nonce, acceptor_nonce, purpose)
    return hmac.compare_digest(shown.encode(), want.encode())


def purpose(msg: dict[str, Any]) -> str:
    """What a hello asks for: the session link, or one direction of a stream lane."""
    return f"stream:{msg.get('direction', 0)}" if msg.get("stream") else "session"
