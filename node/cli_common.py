"""What the ``swarmd`` commands share: the exit codes and their error, the config a command loads (file, flags and
``--set``), logging, and the training loops a config may name."""

from __future__ import annotations

import logging
import sys

from swarmd.node.config import ConfigError, load_config

EXIT_RUNTIME = 1
EXIT_USAGE = 2


class Fail(Exception):
    def __init__(self, message: str, code: int = EXIT_RUNTIME):
        super().__init__(message)
        self.code = code


def _overrides(**flags) -> dict:
    """CLI flags -> config overrides (only the flags the user gave)."""
    mapping = {
        "data_dir": ("node", "data_dir"),
        "swarm": ("node", "swarm"),
        "log_level": ("node", "log_level"),
        "listen": ("network", "listen"),
        "announce": ("network", "announce"),
        "bootstrap": ("network", "bootstrap"),
        "port_mapping": ("network", "port_mapping"),
        "reachability": ("network", "reachability"),
        "http": ("http", "listen"),
    }
    out: dict = {}
    for name, value in flags.items():
        if value is None or value == ():
            continue
        section, key = mapping[name]
        out.setdefault(section, {})[key] = list(value) if isinstance(value, tuple) else value
    return out


def _setup_logging(level: str) -> None:
    from swarmd.transport._compat import load_hivemind

    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    hm = load_hivemind()
    hm.use_hivemind_log_handler("nowhere")  # hivemind logs go through our root handler
    logging.getLogger("hivemind").setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
    for noisy in ("aiohttp.access", "multiaddr", "libp2p", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


# The training loops a config may ask for: [loops.<name>] -> (module, config class, loop class)
LOOPS = {
    "diloco": ("swarmd.protocols.diloco", "DilocoConfig", "DilocoLoop"),
    "spsa": ("swarmd.protocols.spsa", "SpsaConfig", "SPSALoop"),
    "sapo": ("swarmd.protocols.sapo", "SapoConfig", "SapoLoop"),
}


def _load(config_path, flags, settings=()):
    try:
        return load_config(config_path, _overrides(**flags), settings)
    except ConfigError as e:
        raise Fail(str(e), EXIT_USAGE) from None
