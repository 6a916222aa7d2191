"""The CLI as a user runs it: bad input gets one clear line and the documented exit code, never a traceback."""

import socket
import stat

import pytest
import swarmd

from swarmproc import LOCAL_CONFIG, run_cli

PEER = "12D3KooWRLprPmBWgQTLfjEci2hccdjFNWhxDAPs9dA2fVxbmfJw"


def assert_clean_error(result, code, *fragments):
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("swarmd: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr  # one error line, last (after any log lines)
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--bootstrap", "1.2.3.4:4001"], ["--bootstrap", "is not a multiaddr"]),
        (["--bootstrap", "/ip4/1.2.3.4/tcp/4001"], ["--bootstrap", "no /p2p/"]),
        (["--bootstrap", "/ip4/1.2.3.4/tcp/4001/p2p/QmNope"], ["--bootstrap"]),
        (["--listen", "/ip4/1.2.3.4/udp/1"], ["--listen", "QUIC"]),
        (["--http", "nowhere"], ["--http"]),
        (["--config", "/nonexistent.toml"], ["config file /nonexistent.toml not found"]),
        (["--reachability", "maybe"], ["--reachability"]),
        (["--no-such-flag"], ["no-such-flag"]),
    ],
)
@pytest.mark.beside  # a CLI run that exits at once: no deadline to meet
def test_bad_input_exits_2(tmp_path, args, fragments):
    assert_clean_error(run_cli("start", "--data-dir", str(tmp_path), *args), 2, *fragments)


@pytest.mark.beside  # a CLI run that exits at once: no deadline to meet
def test_invalid_config_field(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[discovery]\nmax_peers = 0\n")
    assert_clean_error(run_cli("start", "--config", str(cfg), "--data-dir", str(tmp_path)), 2, "discovery.max_peers")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flag, value, message",
    [("--listen", "/ip4/127.0.0.1/tcp/{port}", "tcp port {port} is already in use"),
     ("--http", "127.0.0.1:{port}", "127.0.0.1:{port} is already in use")],
)
def test_port_in_use(tmp_path, flag, value, message):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = run_cli("start", "--config", str(LOCAL_CONFIG), "--data-dir", str(tmp_path),
                         flag, value.format(port=port))
    assert_clean_error(result, 1, message.format(port=port))


@pytest.mark.timeout(60)
def test_two_nodes_on_one_data_dir(swarm):
    first = swarm.start("shared")
    result = run_cli("start", "--config", str(LOCAL_CONFIG), "--data-dir", str(first.data_dir))
    assert_clean_error(result, 1, "is in use by another swarmd", f"pid {first.pid}")
    assert first.proc.poll() is None  # the first node is unharmed


@pytest.mark.beside  # a CLI run that exits at once: no deadline to meet
def test_keygen_and_id(tmp_path):
    created = run_cli("keygen", "--data-dir", str(tmp_path))
    assert created.returncode == 0, created.stderr
    peer_id = created.stdout.strip()
    assert peer_id.startswith("12D3KooW")
    assert stat.S_IMODE((tmp_path / "identity.key").stat().st_mode) == 0o600
    shown = run_cli("id", "--data-dir", str(tmp_path))
    assert shown.returncode == 0 and shown.stdout.strip() == peer_id
    assert_clean_error(run_cli("keygen", "--data-dir", str(tmp_path)), 1, "already exists", peer_id)
    replaced = run_cli("keygen", "--data-dir", str(tmp_path), "--force")
    assert replaced.returncode == 0 and replaced.stdout.strip() != peer_id


@pytest.mark.beside  # a CLI run that exits at once: no deadline to meet
def test_id_without_identity(tmp_path):
    assert_clean_error(run_cli("id", "--data-dir", str(tmp_path)), 1, "does not exist", "swarmd keygen")


@pytest.mark.beside  # a CLI run that exits at once: no deadline to meet
def test_status_without_a_node(tmp_path):
    assert_clean_error(run_cli("status", "--data-dir", str(tmp_path)), 1, "no running node")
    assert_clean_error(run_cli("peers", "--http", "127.0.0.1:9"), 1, "cannot read")


@pytest.mark.beside  # a CLI run that exits at once: no deadline to meet
def test_help_and_version():
    assert run_cli("--help").returncode == 0
    v = run_cli("--version")
    assert v.returncode == 0 and swarmd.__version__ in v.stdout


@pytest.mark.timeout(60)
def test_a_node_without_loops_does_not_load_torch(swarm):
    # the README says the node itself never imports torch: not even by way of the loops' task machinery
    node = swarm.start("bare")
    with open(f"/proc/{node.pid}/maps") as maps:
        libraries = maps.read()
    assert "libtorch" not in libraries


@pytest.mark.timeout(60)
def test_the_node_sets_its_allocator_as_configured_and_shows_it(swarm):
    default = swarm.start("reuse")
    released = swarm.start("release", "--set", 'node.memory="release"')
    with open(f"/proc/{default.pid}/maps") as maps:
        glibc = "libc.so.6" in maps.read()
    assert default.status()["allocator"]["mode"] == "reuse"
    assert released.status()["allocator"]["mode"] == "release"
    if glibc:  # (musl or another C library: the mode is shown, nothing is set)
        assert default.status()["allocator"]["mmap_threshold"] == 32 << 20
        assert released.status()["allocator"]["mmap_threshold"] == 1 << 20


@pytest.mark.beside  # pure computation
def test_each_demo_swarm_gets_a_fresh_random_name():
    # issue 80 item 7: the demo's cheap 12-bit tickets must not be mintable before its swarm exists
    import re

    from swarmd.node.demo import settings_for

    names = [next(s for s in settings_for("diloco", 3, 1) if s.startswith("node.swarm=")) for _ in range(2)]
    assert all(re.fullmatch(r'node\.swarm="demo-[0-9a-f]{16}"', n) for n in names), names
    assert names[0] != names[1]
