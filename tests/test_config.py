import pytest

from swarmd.node.config import ConfigError, load_config, parse_host_port

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)


def test_embedded_default():
    c = load_config()
    assert c.network.listen == ["/ip4/0.0.0.0/tcp/4001", "/ip4/0.0.0.0/udp/4001/quic-v1"]
    assert c.network.port_mapping is False and c.network.bootstrap == []
    assert c.http.listen == "127.0.0.1:8470"


def test_file_then_flags(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[node]\nswarm = "lab"\n[network]\nlisten = ["/ip4/127.0.0.1/tcp/0"]\n'
                    '[discovery]\npoll_interval = 2.0\n')
    c = load_config(path, {"network": {"listen": ["/ip4/127.0.0.1/tcp/5000"]}})
    assert c.node.swarm == "lab" and c.discovery.poll_interval == 2.0
    assert c.network.listen == ["/ip4/127.0.0.1/tcp/5000"]


@pytest.mark.parametrize(
    "toml, overrides, expected",
    [
        ("[network]\nlisten = []\n", {}, "invalid network.listen (in"),
        ("[network]\nlisten = ['/ip4/1.2.3.4/tcp/x']\n", {}, "network.listen"),
        ("[netwrok]\nlisten = []\n", {}, "invalid netwrok (in"),
        ("[node]\nswarm = 'a b'\n", {}, "node.swarm"),
        ("[node]\nlog_level = 'loud'\n", {}, "node.log_level"),
        ("[discovery]\npoll_interval = -1\n", {}, "discovery.poll_interval"),
        ("[discovery]\nmax_peers = 'many'\n", {}, "discovery.max_peers"),
        ("[network]\nannounce = ['/ip4/1.2.3.4/tcp/0']\n", {}, "explicit port"),
        ("", {"network": {"bootstrap": ["/ip4/1.2.3.4/tcp/1"]}},
         "(from --bootstrap): '/ip4/1.2.3.4/tcp/1' has no /p2p/"),
        ("", {"http": {"listen": "localhost"}}, "http.listen (from --http)"),
        ("[network\n", {}, "not valid TOML"),
    ],
)
def test_errors_are_one_line_and_name_the_field(tmp_path, toml, overrides, expected):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert expected in message and "\n" not in message


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/swarmd.toml")


def test_host_port():
    assert parse_host_port("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_host_port("[::1]:80") == ("::1", 80)
    for bad in ("127.0.0.1", ":80", "h:99999", "[zz]:1"):
        with pytest.raises(ValueError):
            parse_host_port(bad)


def test_example_configs_load():
    from pathlib import Path

    for path in sorted((Path(__file__).parent.parent / "configs").glob("*.toml")):
        load_config(path)


def test_set_overrides_any_setting_with_a_toml_value(tmp_path):
    cfg = load_config(None, {"node": {"swarm": "from-flag"}},
                      ["state.admission_bits=12", 'node.swarm="from-set"', "discovery.poll_interval=0.5",
                       "network.listen=['/ip4/127.0.0.1/tcp/0']", "node.log_level=debug"])
    assert cfg.state.admission_bits == 12 and cfg.node.swarm == "from-set" and cfg.discovery.poll_interval == 0.5
    assert list(cfg.network.listen) == ["/ip4/127.0.0.1/tcp/0"] and cfg.node.log_level == "debug"  # bare word: a str
    with pytest.raises(ConfigError, match=r"invalid state.admission_bits \(from --set\)"):
        load_config(None, None, ["state.admission_bits=-1"])
    with pytest.raises(ConfigError, match="unknown setting"):
        load_config(None, None, ["state.no_such_thing=1"])
    for bad in ("no_equals_sign", "a..b=1", "=1", "a.b c=1"):
        with pytest.raises(ConfigError, match="expected dotted.key=value"):
            load_config(None, None, [bad])
