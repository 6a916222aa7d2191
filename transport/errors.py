"""Transport error types.

Two families, in the spirit of trio's Closed/Broken split, so a handler knows whose fault a failure was:

- :class:`ProtocolViolation` and subclasses: *the remote peer* sent something wrong (malformed, oversized, forged).
  These carry a short ``kind`` used as a metrics label and a penalty key.
- :class:`TransportError` and subclasses: the network or the daemon failed, or we used a closed resource.
"""

from __future__ import annotations


class SwarmdError(Exception):
    """Base of all swarmd errors."""


class IdentityError(SwarmdError):
    """The node identity could not be loaded or created."""


class TransportError(SwarmdError):
    """The network, the peer's availability, or the p2p daemon failed (not the peer's misbehaviour)."""


class DaemonStartError(TransportError):
    """The p2p daemon did not start (bad listen address, port in use, missing binary)."""


class PeerUnreachable(TransportError):
    """No connection or stream could be opened to the peer."""


class StreamClosed(TransportError):
    """The stream ended (cleanly or not) before a whole message arrived."""


class ProtocolViolation(SwarmdError):
    """The remote peer broke the protocol. ``kind`` is a stable short label (metrics, penalties)."""

    kind = "protocol_violation"

    def __init__(self, message: str, *, kind: str | None = None):
        super().__init__(message)
        if kind is not None:
            self.kind = kind


class FrameTooLarge(ProtocolViolation):
    kind = "oversized"


class MalformedMessage(ProtocolViolation):
    kind = "malformed"


class BadSignature(ProtocolViolation):
    kind = "bad_signature"
