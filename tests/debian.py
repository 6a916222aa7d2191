"""What some tests need from the system (iproute2, iptables, chromium, docker.io, ...): installed with apt-get where
it is missing and we can (root, Debian), so a fresh CI machine runs every test the project's own files set up."""

from __future__ import annotations

import os
import shutil
import subprocess


def ensure(tools: dict[str, str]) -> list[str]:
    """``{tool on PATH: Debian package}``: apt-get installs the packages of the missing tools (an ``apt-get update``
    first if the install fails); returns the packages whose tools are still missing."""
    def missing() -> list[str]:
        return [pkg for tool, pkg in tools.items() if shutil.which(tool) is None]

    wanted = missing()
    if wanted and shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", *wanted]
        if subprocess.run(install, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True)
            subprocess.run(install, env=env, capture_output=True)
        wanted = missing()
    return wanted
