"""The container swarm as a user starts it: the image built from this repository (offline: the base from Debian's
packages with debootstrap + docker import, the Python packages from a wheelhouse made here), then
``docker/compose.yaml`` (a bootstrap node and 3 DiLoCo peers on a network this test creates), run until a round
closes, read through the dashboard port compose publishes on the host's loopback.

Skipped, saying why, where Docker cannot run (no root, no docker.io / docker-compose / debootstrap and no apt-get
to install them, a dockerd that does not start). A dockerd this test starts is stopped by its PID at the end."""

from __future__ import annotations

import faulthandler
import fcntl
import json
import os
import random
import re
import subprocess
import time
from pathlib import Path

import pytest

import debian
from swarmd.node import __version__ as swarmd_version
from swarmproc import free_port, http_get, wait_for

pytestmark = pytest.mark.swarm

ROOT = Path(__file__).resolve().parents[1]
TAG = "swarmd:compose-test"
TOOLS = {"dockerd": "docker.io", "docker-compose": "docker-compose", "debootstrap": "debootstrap"}


def _docker_ok() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def docker(tmp_path_factory):
    """A running dockerd (ours if none ran), or a skip saying why there cannot be one.

    Held by one pytest-xdist worker at a time (a lock file both see): the image is built in one worker and the swarm
    run in the other, and two dockerds on one machine would fight over /var/run/docker.pid."""
    if os.geteuid() != 0:
        pytest.skip("the container swarm test needs root (dockerd, debootstrap), as CI runs it")
    missing = debian.ensure(TOOLS)
    if missing:
        pytest.skip(f"Docker cannot run here: {' and '.join(missing)} missing and not installable with apt-get")
    with open(tmp_path_factory.getbasetemp().parent / "swarmd-docker.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield from _dockerd(tmp_path_factory)


def _dockerd(tmp_path_factory):
    started = None
    if not _docker_ok():
        log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
        started = subprocess.Popen(["dockerd"], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                   start_new_session=True)
        deadline = time.monotonic() + 60
        while not _docker_ok():
            if started.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-1500:]
                if started.poll() is None:
                    started.terminate()
                    started.wait(30)
                pytest.skip(f"Docker cannot run here: dockerd did not start ({tail.strip().splitlines()[-1:]})")
            time.sleep(0.2)
    try:
        yield
    finally:
        if started is not None and started.poll() is None:
            started.terminate()  # by its PID: the dockerd this test started, no other
            try:
                started.wait(30)
            except subprocess.TimeoutExpired:
                started.kill()
                started.wait(10)


def _compose_cmd() -> list[str]:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"]


def build_image() -> None:
    # the build's containers are dockerd's children, not this worker's: the lowest CPU weight keeps them, as the
    # niced worker, from taking CPU the real-time tests want
    built = subprocess.run([str(ROOT / "docker" / "build-offline.sh"), TAG], cwd=ROOT, capture_output=True,
                           text=True, timeout=720, env={**os.environ, "SWARMD_BUILD_CPU_SHARES": "2"})
    assert built.returncode == 0, f"the image did not build:\n{built.stderr[-3000:]}"


# Built first, in the worker beside the real-time tests (its work is pip's and dockerd's, with no deadline but the
# build's own timeout), so that the swarm test, which runs last, finds every layer in Docker's cache.
@pytest.mark.beside
@pytest.mark.first
@pytest.mark.timeout(900)
def test_the_image_builds_offline_from_this_repository(docker):
    # at niceness 19 beside the real-time tests the build may take longer than faulthandler_timeout (170 s), whose
    # stack dump would be noise here: this test's own timeout (900 s) still holds
    faulthandler.cancel_dump_traceback_later()
    build_image()
    out = subprocess.run(["docker", "run", "--rm", TAG, "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split()[-1] == swarmd_version, out.stdout + out.stderr


@pytest.mark.last
@pytest.mark.timeout(900)
def test_the_compose_swarm_built_from_this_repository_closes_a_round(docker, tmp_path):
    build_image()  # this repository's tree as it is now: with the image built above, Docker's cache has every layer
    port = free_port()
    project = f"swarmdtest{os.getpid()}"
    env = {**os.environ, "SWARMD_IMAGE": TAG, "SWARMD_DASHBOARD_PORT": str(port), "SWARMD_ROUNDS": "3",
           "SWARMD_INNER_STEPS": "10",
           "SWARMD_SUBNET_PREFIX": f"172.29.{random.randint(100, 250)}"}
    compose = [*_compose_cmd(), "-p", project, "-f", str(ROOT / "docker" / "compose.yaml")]
    try:
        up = subprocess.run([*compose, "up", "-d"], env=env, capture_output=True, text=True, timeout=240)
        assert up.returncode == 0, up.stderr[-3000:]
        url = f"http://127.0.0.1:{port}"

        def round_closed():
            s = http_get(url + "/status")
            d = s["services"]["diloco"]
            return s if d.get("rounds", 0) >= 1 else None
        status = wait_for(round_closed, 300, "the container swarm to close a DiLoCo round", interval=1.0)
        diloco = status["services"]["diloco"]
        assert re.fullmatch(r"compose-[0-9a-f]{16}", status["swarm"]), status["swarm"]  # drawn at the first start
        assert diloco["history"][0]["participants"] == 3 and diloco["state"] in ("running", "done")
        # the bootstrap node and the two other peers, as discovery (the DHT's member records, polled on the default
        # config's interval) lists them: it may come after the first round, which needs only the connections
        wait_for(lambda: http_get(url + "/status")["members"] >= 3, 120, "peer1 to list 3 members", interval=1.0)
        assert "<title>swarmd</title>" in http_get(url + "/")
        assert http_get(url + "/dashboard")["loops"][0]["timeline"][0]["participants"] == 3
        # another peer (its endpoint is not published: asked from inside its container) closed the same round
        # with the same global weights
        ask = ("import urllib.request, sys; "
               "sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:8470/status').read().decode())")

        def peer2_round():
            out = subprocess.run([*compose, "exec", "-T", "peer2", "python3", "-c", ask], env=env,
                                 capture_output=True, text=True, timeout=60)
            history = json.loads(out.stdout)["services"]["diloco"]["history"] if out.returncode == 0 else []
            return history[0] if history else None
        first = wait_for(peer2_round, 120, "peer2 to close round 0", interval=1.0)
        assert first["round"] == 0 and first["global_hash"] == diloco["history"][0]["global_hash"]
    except BaseException:
        logs = subprocess.run([*compose, "logs", "--no-color", "--tail", "40"], env=env, capture_output=True,
                              text=True)
        print(logs.stdout[-6000:])
        raise
    finally:
        subprocess.run([*compose, "down", "-v", "-t", "20", "--remove-orphans"], env=env, capture_output=True,
                       timeout=180)
