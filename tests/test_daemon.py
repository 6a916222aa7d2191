"""The p2p daemon's process as swarmd starts it (transport/p2pd.py): the environment it runs in."""

import os
from pathlib import Path

import pytest

from swarmd.transport.identity import Identity
from swarmd.transport.p2pd import DAEMON_GOGC, P2PDaemonConfig, P2PDaemonTransport


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.split("=", 1) for entry in raw.decode().split("\0") if "=" in entry)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("users", [{}, {"GOGC": "200"}, {"GOMEMLIMIT": "200MiB"}])
async def test_the_daemon_collects_its_garbage_at_our_pace_unless_the_user_set_one(users, monkeypatch):
    """The daemon runs with GOGC = DAEMON_GOGC and no heap limit of ours (a 48 MiB soft limit sits just above its
    live heap: its collector runs almost without a pause, twice the daemon's CPU idle or in an exchange);
    a user's own GOGC wins, a GOMEMLIMIT of theirs applies too; this process's environment is left as it was."""
    for name in ("GOGC", "GOMEMLIMIT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in users.items():
        monkeypatch.setenv(name, value)
    transport = P2PDaemonTransport(Identity.generate(), P2PDaemonConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
    await transport.start()
    try:
        env = _environ(transport.daemon_pid)
        assert env["GOGC"] == users.get("GOGC", DAEMON_GOGC) and DAEMON_GOGC == "50"
        assert env.get("GOMEMLIMIT") == users.get("GOMEMLIMIT")
        assert env["LIBP2P_TCP_REUSEPORT"] == "false"
    finally:
        await transport.close()
    assert {name: os.environ.get(name) for name in ("GOGC", "GOMEMLIMIT")} == {
        name: users.get(name) for name in ("GOGC", "GOMEMLIMIT")}
