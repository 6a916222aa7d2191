"""Transport: libp2p host, identity, framing, errors. Knows nothing of training."""
