"""Multiaddr parsing and validation for user input (config, CLI) and peer records.

Uses the ``multiaddr`` package for the grammar; adds the checks swarmd needs (a peer address must end in an
Ed25519 ``/p2p/<id>``; a listen address must be ip4/ip6 + tcp or udp/quic-v1).
"""

from __future__ import annotations

import socket

from multiaddr import Multiaddr

from swarmd.transport.identity import is_valid_peer_id

MAX_ADDR_LEN = 512


def validate_multiaddr(text: str) -> str:
    """Return the canonical string form; raise ValueError with a short reason."""
    if not isinstance(text, str) or not text:
        raise ValueError("empty multiaddr")
    if len(text) > MAX_ADDR_LEN:
        raise ValueError("multiaddr too long")
    if not text.startswith("/"):
        raise ValueError(f"{text!r} is not a multiaddr (it must start with '/', e.g. /ip4/1.2.3.4/tcp/4001)")
    try:
        return str(Multiaddr(text))
    except Exception as e:
        reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise ValueError(f"{text!r} is not a valid multiaddr ({reason})") from None


def split_peer_addr(text: str) -> tuple[str, str]:
    """Split '/ip4/../tcp/../p2p/<id>' into (peer id, transport part). Raises ValueError."""
    text = validate_multiaddr(text)
    if "/p2p/" not in text:
        raise ValueError(f"{text!r} has no /p2p/<peer id> part (bootstrap addresses must name the peer)")
    head, peer_id = text.rsplit("/p2p/", 1)
    if "/" in peer_id or not is_valid_peer_id(peer_id):
        raise ValueError(f"{text!r}: {peer_id[:60]!r} is not an Ed25519 peer id")
    return peer_id, head


def validate_peer_addr(text: str) -> str:
    split_peer_addr(text)
    return validate_multiaddr(text)


def parse_listen_addr(text: str) -> tuple[int, str, str, int]:
    """(address family, host, 'tcp'|'udp', port) of a listen multiaddr. Raises ValueError."""
    parts = validate_multiaddr(text).strip("/").split("/")
    if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] not in ("tcp", "udp"):
        raise ValueError(f"{text!r}: a listen address looks like /ip4/0.0.0.0/tcp/4001 or "
                         "/ip4/0.0.0.0/udp/4001/quic-v1")
    if "/p2p/" in text:
        raise ValueError(f"{text!r}: a listen address must not contain /p2p/")
    if parts[2] == "udp" and parts[4:5] != ["quic-v1"]:
        raise ValueError(f"{text!r}: UDP listen addresses must be QUIC (/udp/<port>/quic-v1)")
    family = socket.AF_INET if parts[0] == "ip4" else socket.AF_INET6
    port = int(parts[3])
    if not 0 <= port <= 65535:
        raise ValueError(f"{text!r}: port out of range")
    return family, parts[1], parts[2], port
