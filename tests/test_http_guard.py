"""The local HTTP endpoint serves only the person running the node (issue 14, item 1): writes need the per-node
token from the data dir, a foreign Host (DNS rebinding) or Origin (a cross-site page) is refused, bodies over a
route's limit are refused before they are read; every refusal is counted and logged."""

import http.client
import json
import os
import socket
import stat
from urllib.parse import urlsplit

import pytest

from swarmproc import Swarm, http_get, http_post, run_cli, wait_for

pytestmark = pytest.mark.swarm


def request(url: str, method: str, path: str, body: bytes = b"", headers: dict | None = None):
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.mark.timeout(120)
def test_only_the_person_running_the_node_can_write_and_foreign_pages_cannot_read(tmp_path):
    swarm = Swarm(tmp_path / "nodes")
    try:
        node = swarm.start("a")
        token_file = node.data_dir / "http.token"
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600 and len(token_file.read_text()) == 64
        host = urlsplit(node.url).netloc
        before = http_get(node.url + "/state")["ops"]
        op = json.dumps({"ops": [{"object": "rounds", "payload": {"v": 2**53}}]}).encode()

        # a web page's form or fetch: no token (text/plain needs no preflight), with and without its Origin
        assert request(node.url, "POST", "/crdt", op, {"Content-Type": "text/plain"})[0] == 401
        assert request(node.url, "POST", "/crdt", op, {"Content-Type": "text/plain",
                                                       "Origin": "http://evil.example"})[0] == 403
        for path in ("/topics/chat", "/bulk", "/topics/chat/subscribe"):
            assert request(node.url, "POST", path, b"x")[0] == 401
        # the token from another place is not enough from a foreign origin either
        auth = {"Authorization": f"Bearer {token_file.read_text()}"}
        assert request(node.url, "POST", "/crdt", op, {**auth, "Origin": "http://evil.example"})[0] == 403
        # DNS rebinding: our address under another name; reads refused too
        for path in ("/status", "/state", "/"):
            assert request(node.url, "GET", path, headers={"Host": f"evil.example:{urlsplit(node.url).port}"})[0] \
                == 421
        assert request(node.url, "GET", "/status", headers={"Host": host})[0] == 200
        assert request(node.url, "GET", "/status",
                       headers={"Host": f"localhost:{urlsplit(node.url).port}"})[0] == 200
        # bodies over the route's limit are refused before they are read
        status, _ = request(node.url, "POST", "/crdt", b"", {**auth, "Content-Length": str(64 << 20)})
        assert status == 413
        assert request(node.url, "POST", "/topics/chat/subscribe", b"x" * 10_000, auth)[0] == 413
        too_many = {"ops": [{"object": "kv", "payload": {"k": f"{node.peer_id}/{i}", "v": i}} for i in range(1001)]}
        assert request(node.url, "POST", "/crdt", json.dumps(too_many).encode(), auth)[0] == 413
        assert http_get(node.url + "/state")["ops"] == before  # nothing was written

        # the person running the node: the CLI reads the token from the data dir
        result = run_cli("write", "kv", json.dumps({"k": f"{node.peer_id}/note", "v": "hi"}),
                         "--data-dir", str(node.data_dir))
        assert result.returncode == 0, result.stderr
        assert http_post(node.url + "/crdt", json_body={"ops": [{"object": "kv", "payload": {
            "k": f"{node.peer_id}/x", "v": 1}}]})["ops"]
        wait_for(lambda: http_get(node.url + "/state")["ops"] == before + 2, 10, "both writes")
        result = run_cli("write", "kv", "{}", "--http", node.url, "--data-dir", str(tmp_path / "elsewhere"))
        assert result.returncode == 1 and "http.token" in result.stderr

        metrics = http_get(node.url + "/metrics")
        for kind, least in (("unauthorized", 4), ("foreign_origin", 2), ("bad_host", 3), ("too_large", 2),
                            ("too_many_ops", 1)):
            line = next(x for x in metrics.splitlines() if f'kind="http_{kind}"' in x)
            assert float(line.split()[-1]) >= least, line
        assert node.log().count("http: refused") <= 5  # once a minute per kind
    finally:
        swarm.close()


@pytest.mark.timeout(120)
def test_bound_to_every_address_the_guard_stays_on(tmp_path):
    # the image and the compose swarm bind 0.0.0.0: a rebinding page (a foreign Host) and a cross-site page (a
    # foreign Origin) are still refused; loopback names, the machine's own addresses (at any port: a published
    # port is not ours) and the user's own names are served
    import psutil

    swarm = Swarm(tmp_path / "nodes")
    try:
        node = swarm.start("a", "--http", "0.0.0.0:0", "--set", 'http.allowed_hosts=["Swarm.LAN"]')
        port = urlsplit(node.url).port
        for path in ("/status", "/state", "/dashboard", "/"):
            assert request(node.url, "GET", path, headers={"Host": f"evil.example:{port}"})[0] == 421
            assert request(node.url, "GET", path, headers={"Host": "evil.example"})[0] == 421
        own = next((a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                    if a.family == socket.AF_INET and not a.address.startswith("127.")), None)
        for host in (f"127.0.0.1:{port}", "127.0.0.1:18470", f"localhost:{port}", "swarm.lan:8470",
                     *([f"{own}:{port}"] if own else [])):
            assert request(node.url, "GET", "/status", headers={"Host": host})[0] == 200, host
        # Origin is always checked: a foreign page's fetch, read or write, under our own Host
        token = {"Authorization": f"Bearer {node.token}"}
        op = json.dumps({"ops": [{"object": "kv", "payload": {"k": f"{node.peer_id}/x", "v": 1}}]}).encode()
        assert request(node.url, "GET", "/status", headers={"Host": f"127.0.0.1:{port}",
                                                             "Origin": "http://evil.example"})[0] == 403
        assert request(node.url, "POST", "/crdt", op, {**token, "Host": f"127.0.0.1:{port}",
                                                       "Origin": "http://evil.example"})[0] == 403
        # the dashboard's own page (its origin is the Host it was loaded from) reads and writes
        assert request(node.url, "GET", "/dashboard", headers={"Host": "127.0.0.1:18470",
                                                                "Origin": "http://127.0.0.1:18470"})[0] == 200
        assert request(node.url, "POST", "/crdt", op, {**token, "Host": f"localhost:{port}",
                                                       "Origin": f"http://localhost:{port}"})[0] == 200
        metrics = http_get(f"http://127.0.0.1:{port}/metrics")
        for kind, least in (("bad_host", 8), ("foreign_origin", 2)):
            line = next(x for x in metrics.splitlines() if f'kind="http_{kind}"' in x)
            assert float(line.split()[-1]) >= least, line
    finally:
        swarm.close()


def answer(status: int, body: bytes) -> tuple[int, dict]:
    return status, json.loads(body) if body.startswith(b"{") else {"error": body.decode()}


@pytest.mark.timeout(120)
def test_malformed_writes_of_the_token_holder_get_clean_refusals(tmp_path):
    swarm = Swarm(tmp_path / "nodes")
    try:
        node = swarm.start("a")
        auth = {"Authorization": f"Bearer {node.token}", "Content-Type": "application/json"}
        before = http_get(node.url + "/state")["ops"]

        def write(value: str) -> tuple[int, dict]:
            body = '{"ops": [{"object": "kv", "payload": {"k": "%s/x", "v": %s}}]}' % (node.peer_id, value)
            return answer(*request(node.url, "POST", "/crdt", body.encode(), auth))

        for depth in (100_000, 990, 40):  # past the parser's recursion limit, just under it, and past ours
            status, reply = write("[" * depth + "]" * depth)
            assert status == 400 and "nested deeper" in reply["error"], (depth, status, reply)
        assert write("[[1]]")[0] == 200
        for rm in ([1], {"a": 1}, None):  # an OR-set removal names an element (a string)
            body = json.dumps({"ops": [{"object": "members", "payload": {"rm": rm}}]}).encode()
            status, reply = answer(*request(node.url, "POST", "/crdt", body, auth))
            assert status == 422 and "malformed" in reply["error"], (rm, status, reply)
        assert http_get(node.url + "/state")["ops"] == before + 1
        metrics = http_get(node.url + "/metrics")
        for kind, least in (("bad_body", 3), ("rejected_write", 3)):
            line = next(x for x in metrics.splitlines() if f'kind="http_{kind}"' in x)
            assert float(line.split()[-1]) >= least, line
    finally:
        swarm.close()
