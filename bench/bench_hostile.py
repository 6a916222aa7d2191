"""A node under each attack of issue 14, next to the same node idle in the same run; then 100 fresh keys against
honest 4-peer DiLoCo, SPSA and SAPO runs, next to the same runs unattacked.

    python bench/bench_hostile.py              # both parts (about 10 minutes on 2 cores)
    python bench/bench_hostile.py --part node  # the single-node attacks only
    python bench/bench_hostile.py --part node --attacks 15   # the idle row and attack 15 only
    python bench/bench_hostile.py --part node --attacks 15 --nofile 1024   # ... the node limited to 1024 fds
    python bench/bench_hostile.py --part loops # the loop runs only
    python bench/bench_hostile.py --part lockout --identities 30000   # admitted identities vs a newcomer (issue 80)
    python bench/bench_hostile.py --part members   # the DHT members key flooded with admitted records (issue 80)
    python bench/bench_hostile.py --part closed    # outsiders reading a closed swarm's state (issue 80)

Part 1: node ``a`` (with an honest peer ``b``) on loopback. For each attack, from fresh hostile processes' keys: the
node's RSS (its Python process; its p2p daemon apart) before, at the peak while attacked and after; ``/healthz``
p50 / p99 / max, probed every 20 ms throughout; the refusals the node counted; and whether an honest write on ``a``
still reaches ``b`` (and in how long). The first row is the node idle for as long as an attack lasts.

Part 2: four honest nodes run a loop to the end twice, once alone and once while one directly connected hostile peer
relays messages from 100 fresh keys (each key's "ready", joins, bogus round hashes, rounds far ahead, well-formed
junk updates). Stalled: the run's wall time next to the unattacked one; forked: the honest nodes end on different
weights; jumped: a round number moved by anyone else's message; resynced: an honest node fetched weights because
of them.

Goals (issue 14): RSS growth <= 64 MB under any single attack, /healthz p99 <= 50 ms, honest writes and rounds
unaffected, and the 100 keys unable to stall, fork, jump or resync any run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from swarmproc import Swarm, http_get, http_post, loop_config, wait_for  # noqa: E402

from swarmd.crdt.admission import Admission  # noqa: E402
from swarmd.crdt.ops import make_op  # noqa: E402
from swarmd.node.crdt_wire import CRDT_SPEC, PUSH  # noqa: E402
from swarmd.transport.identity import Identity  # noqa: E402
from swarmd.transport.p2pd import P2PDaemonConfig, P2PDaemonTransport  # noqa: E402
from swarmd.transport.wire import WIRE  # noqa: E402

MB = 1 << 20


# ------------------------------------------------------------------ measuring
class Probe:
    """/healthz every 20 ms and the node's RSS every 50 ms, in a thread, until stopped."""

    def __init__(self, node):
        self.node, self.proc = node, psutil.Process(node.pid)
        self.latencies: list[float] = []
        self.failures = 0
        self.peak = self.rss()
        self.fds_before = self.fds = self.proc.num_fds()  # the most file descriptors its Python process held at once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        return self.proc.memory_info().rss

    def daemon_rss(self) -> int:
        return sum(c.memory_info().rss for c in self.proc.children(recursive=True))

    def _run(self) -> None:
        last_rss = 0.0
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                http_get(self.node.url + "/healthz", timeout=5)
                self.latencies.append(time.perf_counter() - t0)
            except Exception:  # noqa: BLE001 - a failed probe is what we count
                self.failures += 1
            if time.monotonic() - last_rss > 0.05:
                self.peak, last_rss = max(self.peak, self.rss()), time.monotonic()
                try:
                    self.fds = max(self.fds, self.proc.num_fds())
                except psutil.Error:
                    pass
            self._stop.wait(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def quantiles(self) -> tuple[float, float, float]:
        xs = sorted(self.latencies) or [float("nan")]
        return (statistics.median(xs) * 1e3, xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1e3, xs[-1] * 1e3)


def refusals(status: dict) -> int:
    crdt = status["crdt"]
    return (sum(crdt.get("rejected", {}).values()) + sum(status.get("errors", {}).values())
            + sum(status["dht"].get("records_refused", {}).values())
            + sum(v for k, v in status["services"].get("bulk", {}).items() if k.startswith("refused")
                  or k.startswith("announcements_") or k in ("connections_evicted", "connections_refused_full"))
            + sum(status.get("penalties", {}).values()))


def honest_write(a, b, key: str) -> float | None:
    """Seconds for a write on ``a`` to be read on ``b`` (None: not within 30 s)."""
    t0 = time.monotonic()
    try:
        http_post(a.url + "/crdt", json_body={"ops": [{"object": "kv", "payload": {"k": f"{a.peer_id}/{key}",
                                                                                     "v": key}}]})
        wait_for(lambda: http_get(b.url + "/state")["objects"]["kv"].get(f"{a.peer_id}/{key}") == key, 30,
                 "the honest write", interval=0.02)
    except Exception:  # noqa: BLE001
        return None
    return time.monotonic() - t0


# ------------------------------------------------------------------ attackers
async def attacker(target) -> P2PDaemonTransport:
    t = P2PDaemonTransport(Identity.generate(), P2PDaemonConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
    await t.start()
    await t.connect(target.tcp_addr)
    return t


async def push_ops(target, wires: list, per_message: int = 1000, attackers: int = 1) -> None:
    """PUSH ops to the node from ``attackers`` fresh peers (each is banned soon: the next one goes on)."""
    chunks = [wires[i:i + per_message] for i in range(0, len(wires), per_message)]
    for k in range(attackers):
        t = await attacker(target)
        try:
            async with await t.open_stream(target.peer_id, CRDT_SPEC, timeout=10) as stream:
                for chunk in chunks[k::attackers]:
                    await stream.send(PUSH, {"ops": chunk})
                    await asyncio.wait_for(stream.read_required(), 30)
        except Exception:  # noqa: BLE001 - refused or banned mid-way: the attack is over for this key
            pass
        finally:
            await t.close()


def now_ms() -> int:
    return int(time.time() * 1000)


async def attack_http(a, b) -> None:
    """Unauthenticated and cross-origin writes, foreign-Host reads, oversized bodies."""
    import urllib.error
    import urllib.request

    def req(path, data=None, headers=None, method="GET"):
        try:
            urllib.request.urlopen(urllib.request.Request(a.url + path, data=data, method=method,
                                                          headers=headers or {}), timeout=30).read()
        except (urllib.error.URLError, ConnectionError, OSError):
            pass

    body = b'{"ops": [{"object": "rounds", "payload": {"v": 9007199254740992}}]}'
    for _ in range(200):
        req("/crdt", body, {"Content-Type": "text/plain", "Origin": "http://evil.example"}, "POST")
        req("/status", headers={"Host": "evil.example:8470"})
    big = b"x" * (64 * MB)
    for _ in range(4):
        req("/bulk", big, {"Content-Type": "application/octet-stream"}, "POST")
    ops = [{"object": "kv", "payload": {"k": f"{a.peer_id}/k{i}", "v": i}} for i in range(20_000)]
    req("/crdt", json.dumps({"ops": ops}).encode(), {"Content-Type": "application/json"}, "POST")


async def attack_free_identities(a, b) -> None:
    """5,000 fresh keys each writing its op #1 (a member add) with no admission ticket."""
    now = now_ms()
    keys = await asyncio.to_thread(lambda: [Identity.generate() for _ in range(5000)])
    wires = [make_op(k.sign, k.peer_id, 1, (now, 0), [], "members", {"add": k.peer_id}).wire() for k in keys]
    await push_ops(a, wires, attackers=5)


async def attack_bought_identities(a, b, n: int = 2000, bits: int = 12) -> None:
    """2,000 keys with admission tickets (at this swarm's 12 bits; the default 22 would cost ~70 CPU-minutes)."""
    adm, now = Admission(a.status()["swarm"], bits), now_ms()

    def make():
        out = []
        for _ in range(n):
            k = Identity.generate()
            out.append(make_op(k.sign, k.peer_id, 1, (now, 0), [], "members",
                               {"add": k.peer_id, "ticket": adm.mint(k.peer_id)}).wire())
        return out

    await push_ops(a, await asyncio.to_thread(make))


async def attack_orphans(a, b) -> None:
    """10,000 ops with 64 unknown parents each, from 20 keys."""
    now = now_ms()

    def make():
        out = []
        for _ in range(20):
            k = Identity.generate()
            for seq in range(2, 502):
                parents = [os.urandom(32) for _ in range(64)]
                out.append(make_op(k.sign, k.peer_id, seq, (now, 0), parents, "events", {"n": 1}).wire())
        return out

    await push_ops(a, await asyncio.to_thread(make), per_message=500, attackers=2)


async def attack_frame_bombs(a, b) -> None:
    """Eight 8 MiB frames of empty maps at once on the CRDT protocol (each as many containers as the decode budget
    lets through before it refuses)."""
    from hostile import empty_map_bomb, send_raw_frames

    t = await attacker(a)
    try:
        await send_raw_frames(t, a.peer_id, CRDT_SPEC, empty_map_bomb(), 8, timeout=20)
    finally:
        await t.close()


async def attack_admitted_junk(a, b) -> None:
    """One admitted author writing 2,000 valid kv ops of ~3.4 KB, each with about as many nested empty containers as
    the decode budget allows for its size (one per 16 bytes)."""
    adm, now = Admission(a.status()["swarm"], 12), now_ms()
    k = Identity.generate()

    def make():
        first = make_op(k.sign, k.peer_id, 1, (now, 0), [], "members",
                        {"add": k.peer_id, "ticket": adm.mint(k.peer_id)})
        out, prev = [first.wire()], first.id
        for seq in range(2, 2002):
            op = make_op(k.sign, k.peer_id, seq, (now + seq, 0), [prev], "kv",
                         {"k": f"{k.peer_id}/j{seq}", "v": {"pad": "x" * 3000, "m": [[{}] * 30] * 6}})
            out.append(op.wire())
            prev = op.id
        return out

    await push_ops(a, await asyncio.to_thread(make))


async def attack_streams(a, b) -> None:
    """300 idle pubsub streams from one peer."""
    from swarmd.protocols.gossip import PUBSUB_SPEC

    t = await attacker(a)
    streams = []
    try:
        for _ in range(300):
            try:
                streams.append(await t.open_stream(a.peer_id, PUBSUB_SPEC, timeout=5))
            except Exception:  # noqa: BLE001 - refused over the cap
                pass
        await asyncio.sleep(2)
    finally:
        for s in streams:
            await s.close()
        await t.close()


async def attack_fresh_key_streams(a, b, keys: int = 9, each: int = 64) -> str:
    """Issue 80 item 5: fresh keys (no standing) each holding 64 idle pubsub streams, past the node's global
    inbound cap of 512 if all were taken; meanwhile a member (b) writes, and its sync to a needs streams of a's."""
    from swarmd.protocols.gossip import PUBSUB_SPEC

    ts = await asyncio.gather(*(attacker(a) for _ in range(keys)))
    streams = []

    async def hold(t):
        for _ in range(each):
            try:
                streams.append(await t.open_stream(a.peer_id, PUBSUB_SPEC, timeout=5))
            except Exception:  # noqa: BLE001 - refused (over its cap, banned)
                pass

    try:
        await asyncio.gather(*(hold(t) for t in ts))
        write = await asyncio.to_thread(honest_write, b, a, "amid-streams")
        return f"{len(streams)} streams asked; member write amid: " + (
            "LOST" if write is None else f"{write * 1e3:.0f} ms")
    finally:
        for s in streams:
            await s.close()
        await asyncio.gather(*(t.close() for t in ts), return_exceptions=True)


async def attack_bulk_connections(a, b, count: int = 3000) -> None:
    """``count`` TCP connections to the node's bulk port that never send a request, held while ``b`` pulls a blob
    of ``a``'s through it (raises if that pull fails): a full server closes the longest waiting of the flooding
    host to take a new connection (rather than holding every one, a descriptor each, for 10 s)."""
    host, port = (await asyncio.to_thread(a.status))["services"]["bulk"]["addrs"][0].rsplit(":", 1)
    put = await asyncio.to_thread(http_post, a.url + "/bulk?codec=raw", os.urandom(1 << 20))
    await asyncio.to_thread(wait_for, lambda: b.status()["services"]["bulk"]["announcements"] >= 1, 20,
                            "the blob's announcement at b")
    held = []
    try:
        for _ in range(count):
            held.append((await asyncio.open_connection(host, int(port)))[1])
        pulled = await asyncio.to_thread(http_post, f"{b.url}/bulk/{put['hash']}/pull", timeout=60)
        if pulled.get("size") != 1 << 20:
            raise RuntimeError(f"the member's pull failed: {pulled}")
        await asyncio.sleep(1)
    finally:
        for writer in held:
            writer.close()


async def attack_dht(a, b) -> None:
    """A junk entry under the members key and 2,000 unsigned records with a 31-year expiry on other keys."""
    from hivemind.dht.routing import DHTID
    from hivemind.utils.serializer import MSGPackSerializer

    from swarmd.dht.records import Ed25519RecordValidator, dht_key_id, owner_tag
    from swarmd.transport._compat import load_hivemind

    hm = load_hivemind()
    key = a.status()["dht"]["members_key"]
    mallory = Identity.generate()
    t = P2PDaemonTransport(mallory, P2PDaemonConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
    await t.start()
    try:
        await t.connect(a.tcp_addr)
        lax = Ed25519RecordValidator(mallory, [key])
        node = await hm.DHTNode.create(p2p=t.hivemind_p2p, record_validator=lax)
        peer = hm.PeerID.from_base58(a.peer_id)
        subkey = MSGPackSerializer.dumps(owner_tag(mallory.peer_id))
        junk = hm.DHTRecord(dht_key_id(key), subkey, b"\xc1" * 16, hm.get_dht_time() + 300)
        await node.protocol.call_store(peer, [DHTID.from_bytes(junk.key)], [lax.sign_value(junk)],
                                       junk.expiration_time, subkeys=[owner_tag(mallory.peer_id)])
        far = hm.get_dht_time() + 31 * 365 * 86400
        for i in range(0, 2000, 100):
            keys = [DHTID.generate(source=f"junk{i + j}") for j in range(100)]
            await node.protocol.call_store(peer, keys, [os.urandom(1000) for _ in keys], far)
        await node.shutdown()
    finally:
        await t.close()


async def flood_bulk_topic(a, tmp: Path, messages) -> None:
    """Messages on the bulk announcement topic from one linked peer, until they run out or it is banned."""
    from hostile import HostilePeer

    h = HostilePeer(tmp)
    try:
        await h.start(a, "swarmd/bulk", max_size=4096)
        for i, m in enumerate(messages):
            await h.send(m)
            if i % 500 == 0:
                await asyncio.sleep(0)
    except Exception:  # noqa: BLE001 - banned mid-way: the attack is over
        pass
    finally:
        try:
            await h.close()
        except Exception:  # noqa: BLE001 - a link the node dropped may not close cleanly
            pass


async def attack_gossip(a, b, tmp: Path) -> None:
    """2,000 junk messages on the bulk announcement topic from one linked peer."""
    await flood_bulk_topic(a, tmp / "gossip", ({"k": 1, "v": 1, "junk": i} for i in range(2000)))


async def attack_announcements(a, b, tmp: Path) -> None:
    """20,000 well-formed bulk announcements from one key (capped per author)."""
    from swarmd.protocols.bulk import ANNOUNCE

    await flood_bulk_topic(a, tmp / "ann", (WIRE.pack(ANNOUNCE, {
        "hash": os.urandom(32), "size": 1000, "codec": "raw", "topic": "diloco/x", "round": i, "fragment": 0,
        "addrs": ["127.0.0.1:9"]}) for i in range(20_000)))


async def part_node(tmp: Path, only: set[str] = frozenset(), nofile: int = 0) -> list[dict]:
    swarm = Swarm(tmp / "nodes")
    rows = []
    try:
        a, b = await asyncio.to_thread(swarm.start_chain, 2)
        if nofile:  # the attacked node's descriptor limit, as a user's shell may set it (ulimit -n)
            import resource

            resource.prlimit(a.proc.pid, resource.RLIMIT_NOFILE, (nofile, nofile))
        await asyncio.sleep(3)  # let start-up allocations settle before the first measurement
        attacks = [
            ("idle (same node, 10 s)", lambda: asyncio.sleep(10)),
            ("1 HTTP: foreign writes/reads, 4x64 MiB, 20k ops", lambda: attack_http(a, b)),
            ("3 5,000 fresh keys write op #1", lambda: attack_free_identities(a, b)),
            ("3 2,000 bought (ticketed) keys", lambda: attack_bought_identities(a, b)),
            ("4 10,000 orphans x 64 parents", lambda: attack_orphans(a, b)),
            ("4 8 x 8 MiB frames of empty maps at once", lambda: attack_frame_bombs(a, b)),
            ("4 2,000 valid ops of empty maps", lambda: attack_admitted_junk(a, b)),
            ("9 300 idle streams", lambda: attack_streams(a, b)),
            ("80.5 9 fresh keys x 64 idle streams", lambda: attack_fresh_key_streams(a, b)),
            ("2 DHT junk member + 2,000 records", lambda: attack_dht(a, b)),
            ("8 2,000 junk gossip messages", lambda: attack_gossip(a, b, tmp)),
            ("10 20,000 bulk announcements", lambda: attack_announcements(a, b, tmp)),
            ("15 3,000 idle bulk connections, a pull amid", lambda: attack_bulk_connections(a, b)),
        ]
        if only:
            attacks = [x for x in attacks if x[0].startswith("idle") or x[0].split()[0] in only]
        for i, (name, attack) in enumerate(attacks):
            before_status = await asyncio.to_thread(a.status)
            probe = Probe(a)
            before = probe.rss()
            t0 = time.monotonic()
            with probe:
                try:
                    said = await asyncio.wait_for(attack(), 300)
                    error = said if isinstance(said, str) else ""  # what the attack measured itself
                except Exception as e:  # noqa: BLE001 - reported in the table
                    error = f"{type(e).__name__}: {e}"[:60]
                await asyncio.sleep(1)
            after = probe.rss()
            alive = a.proc.poll() is None
            write = await asyncio.to_thread(honest_write, a, b, f"h{i}") if alive else None
            status = await asyncio.to_thread(a.status) if alive else before_status
            p50, p99, worst = probe.quantiles()
            seconds = min(60, int(time.monotonic() - t0) + 3)  # this attack's seconds (and the write after it)
            lag = max(status["event_loop"]["lag_ms_by_second"][-seconds:]) if alive else float("nan")
            rows.append({"attack": name, "seconds": time.monotonic() - t0, "rss_before": before / MB, "lag": lag,
                         "rss_peak": probe.peak / MB, "rss_after": after / MB, "daemon": probe.daemon_rss() / MB,
                         "p50": p50, "p99": p99, "max": worst, "failed": probe.failures,
                         "refused": refusals(status) - refusals(before_status), "write": write, "alive": alive,
                         "fds": (probe.fds_before, probe.fds),
                         "error": error})
            print(f"  {name}: done in {rows[-1]['seconds']:.0f} s", flush=True)
            if not alive:
                break
    finally:
        await asyncio.to_thread(swarm.close)
    return rows


def print_node(rows: list[dict]) -> None:
    print("\nPart 1: one node under each attack (item numbers from issue 14), idle first")
    print(f"{'attack':48} | {'RSS MB before/peak/after':>24} | {'growth':>6} | {'healthz ms p50/p99/max':>22} | "
          f"{'loop lag':>8} | {'fail':>4} | {'refused':>7} | {'fds before/peak':>15} | {'honest write':>12}")
    for r in rows:
        rss = f"{r['rss_before']:.0f}/{r['rss_peak']:.0f}/{r['rss_after']:.0f}"
        hz = f"{r['p50']:.1f}/{r['p99']:.1f}/{r['max']:.1f}"
        write = "LOST" if r["write"] is None else f"{r['write'] * 1e3:.0f} ms"
        print(f"{r['attack']:48} | {rss:>24} | {r['rss_peak'] - r['rss_before']:>5.0f}M | {hz:>22} | "
              f"{r['lag']:>6.0f}ms | {r['failed']:>4} | {r['refused']:>7} | {'%d/%d' % r['fds']:>15} | {write:>12}"
              + (f"  ({r['error']})" if r["error"] else ""))
    print("growth: the peak RSS while attacked over the RSS before (the node's Python process; its p2p daemon is "
          "a separate process). healthz: as a client on the same 2 cores sees it (the attacker's processes compete "
          "for them); loop lag: the node's own largest event-loop timer lag over the last minute (/status); fds: the "
          "file descriptors its Python process held, before and at most while attacked (sampled with its RSS). "
          "goals: growth <= 64 MB, /healthz p99 <= 50 ms, every honest write delivered")


# ------------------------------------------------------------------ part 2: 100 fresh keys against the loops
def _loop_configs() -> dict[str, str]:
    """The loop tables of the tests' own runs (tests/test_diloco.py, test_spsa.py), at bench sizes."""
    from test_diloco import CONFIG as DILOCO
    from test_spsa import CONFIG as SPSA

    return {"diloco": DILOCO.format(run="{run}", rounds=6, h=20, fragments=1, overlap=0, alpha=0.0, min_peers=4,
                                    deadline_low=2.0, codec="e3m0"),
            "spsa": SPSA.format(run="{run}", steps=150, min_peers=4), "sapo": SAPO}


SAPO = """
[loops.sapo]
run = "{run}"
rounds = 12
min_peers = 4
deadline = 5.0
report_every = 5

[loops.sapo.task_options]
d = 32
layers = 1
heads = 2
"""


def junk_for(loop: str, s: dict, key: Identity, tag: list) -> list[dict]:
    """What one fresh key sends, given the run's status as the first honest node reports it."""
    if loop == "diloco":
        r = s.get("rounds", 0)
        out = [{"r": 0, "p": 0, "ready": "0" * 32}]
        for rr in range(r, r + 3):
            out += [{"r": rr, "p": 0, "h": "f" * 32}, {"r": rr, "p": 0, "join": True},
                    {"r": rr, "p": 0, "parts": [os.urandom(32)], "sizes": [1000], "base": "0" * 32,
                     "norm": 1.0, "addrs": []}]
    elif loop == "spsa":
        w = s.get("window", 0)
        out = [{"w": 0, "ready": "0" * 32}]
        for ww in range(w, w + 3):
            out += [{"w": ww, "h": "f" * 32}, {"w": ww, "join": True}, {"w": ww, "b": b"\x01" * 25, "h": bytes(8)}]
    else:
        from swarmd.protocols.sapo import question_seed

        out = [{"r": 0, "ready": True}]
        for r in (s.get("round", 0) + 1, 11, 299):
            out.append({"r": r, "items": [{"spec": ["arith", question_seed(s["run"], 1, key.peer_id, r), k],
                                           "comps": ["1", "2"]} for k in range(2)]})
    return [WIRE.pack(_kind_of(loop, m), {**m, "t": tag}) for m in out]


def _kind_of(loop: str, body: dict):
    """The wire kind of a loop message, by its fields (transport.wire)."""
    from swarmd.protocols import diloco, sapo, spsa

    module = {"diloco": diloco, "spsa": spsa, "sapo": sapo}[loop]
    for kind in (k for k in WIRE.kinds.values() if k.carrier == module.CARRIER):
        if {name for name, _ in kind.schema.fields} == set(body) | {"t"}:
            return kind
    raise ValueError(f"no {loop} kind with fields {sorted(body)}")


async def one_run(loop: str, tmp: Path, attacked: bool) -> dict:
    from hostile import HostilePeer

    run = f"{loop}-{'attacked' if attacked else 'alone'}"
    template = _loop_configs()[loop]
    config = loop_config(tmp / f"{run}.toml", template.format(run=run))
    swarm = Swarm(tmp / run, config=config)
    hostile = HostilePeer(tmp / f"{run}-hostile") if attacked else None
    keys = [Identity.generate() for _ in range(100)]
    sent, banned = 0, None

    def svc(n):
        return n.status()["services"][loop]

    def cpu_of(pid: int | None) -> float:
        """CPU seconds of a process and its children (a node's p2pd daemon), 0 if it is gone."""
        import psutil

        try:
            proc = psutil.Process(pid)
            return sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])
        except (psutil.Error, TypeError):
            return 0.0

    try:
        t0, bench_cpu = time.monotonic(), time.process_time()
        nodes = await asyncio.to_thread(swarm.start_chain, 4, "n", 60)
        if hostile is not None:
            await hostile.start(nodes[0], f"{loop}/{run}", max_size=64 * 1024)
        while not all(svc(n)["state"] == "done" for n in nodes):
            if time.monotonic() - t0 > 400:
                raise TimeoutError(f"{run}: not done in 400 s")
            if hostile is not None and banned is None:
                s = svc(nodes[0])
                fp = s.get("fingerprint")
                if fp:
                    tag = [fp["layout"], fp["config"]]
                    try:
                        for k in keys:
                            for m in junk_for(loop, s, k, tag):
                                await hostile.send_as(k, m)
                                sent += 1
                    except (ConnectionError, TimeoutError):
                        banned = time.monotonic() - t0  # the node dropped the relay: the attack ends there
            await asyncio.sleep(1.0)
        wall = time.monotonic() - t0
        final = [svc(n) for n in nodes]
        honest_cpu = sum(cpu_of(n.pid) for n in nodes)
        # the attacker's own work, on this machine too: its p2pd daemon, and this process (signing 100 keys' junk)
        attacker_cpu = (cpu_of(hostile.transport.daemon_pid) if hostile is not None else 0.0) \
            + time.process_time() - bench_cpu
    finally:
        if hostile is not None:
            await hostile.close()
        await asyncio.to_thread(swarm.close)
    hashes = {f.get("final_hash") for f in final}
    counted = {"diloco": lambda f: max((h["participants"] for h in f["history"]), default=0),
               "spsa": lambda f: f.get("participants", 0), "sapo": lambda f: f.get("peers_in_round", 0)}[loop]
    where = {"diloco": "round", "spsa": "window", "sapo": "round"}[loop]  # rounds / windows done
    return {"loop": loop, "attacked": attacked, "wall": wall,
            # SAPO peers each train their own policy: there is no shared weight to fork
            "forked": None if loop == "sapo" else len(hashes) != 1,
            "resyncs": sum(f.get("resyncs", 0) for f in final),
            "rounds": [f.get(where) for f in final],
            "most_counted": max(counted(f) for f in final), "sent": sent, "relay_banned_at": banned,
            "honest_cpu": honest_cpu, "attacker_cpu": attacker_cpu,
            "deadline_missed": sum(f.get("deadline_missed", 0) for f in final),
            "detail": final}


async def part_loops(tmp: Path) -> list[tuple[dict, dict]]:
    out = []
    for loop in ("diloco", "spsa", "sapo"):
        alone = await one_run(loop, tmp, attacked=False)
        print(f"  {loop} alone: {alone['wall']:.0f} s", flush=True)
        attacked = await one_run(loop, tmp, attacked=True)
        print(f"  {loop} with 100 fresh keys: {attacked['wall']:.0f} s", flush=True)
        out.append((alone, attacked))
    return out


def print_loops(pairs) -> None:
    print("\nPart 2: 100 fresh keys (relayed by one directly connected hostile peer) against 4 honest peers")
    print(f"{'loop':6} | {'messages':>8} | {'relay banned':>12} | {'wall alone':>10} | {'attacked':>8} | "
          f"{'ratio':>5} | {'honest CPU':>10} | {'attacked':>8} | {'ratio':>5} | {'attacker CPU':>12} | "
          f"{'forked':>6} | {'resyncs':>7} | {'most counted':>12} | {'rounds (honest nodes)':>24}")
    for alone, att in pairs:
        ban = "no" if att["relay_banned_at"] is None else f"at {att['relay_banned_at']:.0f} s"
        print(f"{att['loop']:6} | {att['sent']:>8} | {ban:>12} | {alone['wall']:>9.0f}s | {att['wall']:>7.0f}s | "
              f"{att['wall'] / alone['wall']:>5.2f} | {alone['honest_cpu']:>9.0f}s | {att['honest_cpu']:>7.0f}s | "
              f"{att['honest_cpu'] / alone['honest_cpu']:>5.2f} | {att['attacker_cpu']:>11.0f}s | "
              f"{str(att['forked']):>6} | {att['resyncs']:>7} | {att['most_counted']:>12} | {str(att['rounds']):>24}")
    print("honest CPU: the 4 honest nodes' CPU seconds (their p2pd daemons included), alone and attacked; attacker "
          "CPU: the attacker's own (its p2pd daemon and the process signing its junk), spent on the same 2 cores "
          "here, where a real attacker spends its own")
    print("ratio: the attacked run's wall time over the same run alone (stall); most counted: the most peers any "
          "honest node counted in a round (4 = only the honest ones); rounds: where each honest node ended "
          "(jumped: anything but the run's last round)")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["node", "loops", "lockout", "members", "closed", "all"], default="all")
    parser.add_argument("--identities", type=int, default=30_000, help="the lock-out part's admitted identities "
                        "(minted on every core at 12 bits, about 2 ms each, and kept in /tmp for the next run)")
    parser.add_argument("--bits", type=int, default=12, help="the lock-out part's ticket bits, the nodes' and the "
                        "identities' (default 12, the demo's; from 17 the identities are minted by the native miner "
                        "bench/ticket_miner.c in one process: at 22, the default, about 0.1 s of one core each)")
    parser.add_argument("--mint-only", action="store_true", help="the lock-out part: only mint the identities the "
                        "cache lacks, one cache file at a time, and exit (stopping it keeps every file it completed)")
    parser.add_argument("--attacks", default="", help="part 1's attacks to run, by the numbers their names start "
                        "with, comma-separated (default: all; the idle row always runs)")
    parser.add_argument("--nofile", type=int, default=0, help="part 1: the attacked node's file descriptor limit "
                        "(default: as inherited; 1024 is a common default)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("node", "all"):
            only = {x.strip() for x in args.attacks.split(",") if x.strip()}
            print_node(await part_node(Path(tmp) / "node", only, args.nofile))
        if args.part in ("loops", "all"):
            print_loops(await part_loops(Path(tmp) / "loops"))
        if args.part in ("lockout", "all"):
            from hostile_lockout import SWARM, identities, part_lockout, print_lockout

            if args.mint_only:
                identities(SWARM, args.identities, args.bits, log=lambda line: print(line, flush=True))
                return
            print_lockout(*await part_lockout(Path(tmp) / "lockout", args.identities, bits=args.bits))
        if args.part in ("members", "all"):
            from hostile_doors import part_members, print_members

            print_members(await part_members(Path(tmp) / "members"))
        if args.part in ("closed", "all"):
            from hostile_doors import part_closed, print_closed

            print_closed(await part_closed(Path(tmp) / "closed"))


if __name__ == "__main__":
    asyncio.run(main())
