"""bench_hostile.py's rows for two doors of issue 80, each next to the same swarm unattacked in the same run:

    python bench/bench_hostile.py --part members   # the DHT members key flooded with admitted records
    python bench/bench_hostile.py --part closed    # outsiders reading a closed swarm's state

**members**: two honest nodes ``a`` and ``b`` (configs/local.toml, tickets of 12 bits). Each phase lasts ``WINDOW``
seconds; in it a newcomer starts (bootstrapped from ``a``) and its discovery is timed: from its start to its being a
member at ``a`` and at ``b``. Phase one is unattacked; in phase two a stranger's DHT node first stores ``records``
admitted member records at ``a`` under the members key (valid tickets, 16 addresses each, the largest honest kind,
200 a store). Per phase: ``b``'s member polls done and timed out (a poll of ``a``'s key carries every record ``a``
kept), ``b``'s member count, ``a``'s records evicted and refused, each node's RSS growth (peak over before).

**closed**: two members ``a`` and ``b`` of a closed swarm (``state.allow`` = the two and a reader key). ``a`` holds a
private kv value. Phase one: the reader (on the allowlist) syncs ``a``'s state ``ATTEMPTS`` times, as a member's
sync does (entries, then every author's ops). Phase two: ``OUTSIDERS`` fresh keys do the same, and each also opens a
pubsub stream and subscribes. Meanwhile ``a`` writes and the write's arrival at ``b`` is timed. Per phase: syncs
that got ops, ops received, whether the private value was among them, refusals ``a`` counted, ``a``'s RSS growth.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from hostile_lockout import RssPeaks, local_config
from swarmproc import Swarm, http_get, http_post, wait_for

from swarmd.crdt.admission import Admission
from swarmd.node.crdt_wire import CRDT_SPEC, SYNC, WANT
from swarmd.transport.identity import Identity
from swarmd.transport.p2pd import P2PDaemonConfig, P2PDaemonTransport

BITS = 12  # configs/local.toml's, the demo's
WINDOW = 30.0  # seconds a members phase lasts
RECORDS = 9_000  # about the count that stopped every poll before the members key made room
ATTEMPTS = 40  # syncs per phase of the closed part
OUTSIDERS = 8


# ------------------------------------------------------------------ members key
def low_identity(data_dir: Path, tries: int = 32) -> str:
    """The lowest peer id of ``tries`` fresh identities, written as ``data_dir``'s node key; the peer id."""
    best = min((Identity.generate() for _ in range(tries)), key=lambda k: k.peer_id)
    data_dir.mkdir(parents=True, exist_ok=True)
    best.save(data_dir / "identity.key")
    return best.peer_id


def member_records(status: dict, n: int, above: str) -> list[tuple]:
    """n fresh identities' admitted member records for ``status``'s swarm, signed, as hivemind store arguments.
    Their peer ids sort after ``above``: /status lists its first MAX_PEERS_VIEW peers by id (its counts cover all),
    so the honest nodes, whose ids sort first, stay in the list the bench reads."""
    from hivemind.dht.routing import DHTID
    from hivemind.utils.serializer import MSGPackSerializer

    from swarmd.dht.records import Ed25519RecordValidator, NodeRecord, dht_key_id, owner_tag
    from swarmd.transport._compat import load_hivemind

    hm = load_hivemind()
    key, adm = status["dht"]["members_key"], Admission(status["swarm"], BITS)
    addrs = tuple(f"/ip6/fd00:1234:5678:9abc:def0:1234:5678:{i:04x}/tcp/65535" for i in range(16))
    out, expiry, epoch = [], hm.get_dht_time() + 500, Admission.epoch(time.time())
    while len(out) < n:
        who = Identity.generate()
        if who.peer_id <= above:
            continue
        record = NodeRecord(who.peer_id, addrs, "0", (), time.time(), status["dht"]["admission_rule"],
                            adm.mint_record(who.peer_id, epoch))
        r = hm.DHTRecord(dht_key_id(key), MSGPackSerializer.dumps(owner_tag(who.peer_id)),
                         MSGPackSerializer.dumps(record.to_wire()), expiry)
        out.append((DHTID.from_bytes(r.key), Ed25519RecordValidator(who, [key]).sign_value(r),
                    owner_tag(who.peer_id), expiry))
    return out


async def store_records(a, key: str, records: list[tuple]) -> int:
    """Store ``records`` at ``a`` from a stranger's DHT node, 200 a call; how many calls a answered."""
    from swarmd.dht.records import Ed25519RecordValidator
    from swarmd.transport._compat import load_hivemind

    hm = load_hivemind()
    mallory = Identity.generate()
    t = P2PDaemonTransport(mallory, P2PDaemonConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
    await t.start()
    answered = 0
    try:
        await t.connect(a.tcp_addr)
        node = await hm.DHTNode.create(p2p=t.hivemind_p2p, record_validator=Ed25519RecordValidator(mallory, [key]))
        peer = hm.PeerID.from_base58(a.peer_id)
        for start in range(0, len(records), 200):
            batch = records[start:start + 200]
            said = await node.protocol.call_store(peer, [x[0] for x in batch], [x[1] for x in batch], batch[0][3],
                                                  subkeys=[x[2] for x in batch])
            answered += said is not None
        await node.shutdown()
    finally:
        await t.close()
    return answered


async def members_phase(swarm: Swarm, a, b, name: str, records: list[tuple]) -> dict:
    before_a, before_b = a.status(), b.status()
    rss = RssPeaks([a, b])
    t0 = time.monotonic()
    stored = await store_records(a, before_a["dht"]["members_key"], records) if records else 0
    flood_s = time.monotonic() - t0
    c0 = time.monotonic()
    newcomer = await asyncio.to_thread(swarm.start, f"newcomer-{name}", bootstrap=[a.tcp_addr])
    found = {}
    deadline = t0 + max(WINDOW, flood_s + 20)
    while len(found) < 2 and time.monotonic() < deadline:
        for who, node in (("a", a), ("b", b)):
            peers = await asyncio.to_thread(node.status)
            if who not in found and any(p["peer_id"] == newcomer.peer_id and p["discovered"]
                                        for p in peers["peers"]):
                found[who] = time.monotonic() - c0
        await asyncio.sleep(0.05)
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))
    after_a, after_b = a.status(), b.status()
    growth = rss.stop()
    await asyncio.to_thread(newcomer.stop)

    def dht(s, k):
        return s["dht"].get(k, 0)

    return {"phase": name, "records": len(records), "stored_calls": stored, "flood_s": flood_s,
            "seconds": time.monotonic() - t0, "found": found,
            "polls": dht(after_b, "dht_polls") - dht(before_b, "dht_polls"),
            "timeouts": dht(after_b, "dht_timeouts") - dht(before_b, "dht_timeouts"),
            "members_b": discovered(b),
            "evicted": dht(after_a, "members_key_evicted") - dht(before_a, "members_key_evicted"),
            "refused": dht(after_a, "members_key_refused") - dht(before_a, "members_key_refused"),
            "growth": growth}


def discovered(node) -> int:
    """The members ``node`` has discovered (its swarmd_peers{state="member"} gauge: DHT records and hellos)."""
    metrics = http_get(node.url + "/metrics")
    return int(float(next(line.split()[-1] for line in metrics.splitlines()
                          if line.startswith('swarmd_peers{state="member"}'))))


async def part_members(tmp: Path, n: int = RECORDS) -> list[dict]:
    swarm = Swarm(tmp / "nodes", config=local_config(tmp, BITS))
    honest = [low_identity(tmp / "nodes" / name) for name in ("n0", "n1", "newcomer-unattacked", "newcomer-flooded")]
    try:
        a, b = await asyncio.to_thread(swarm.start_chain, 2)
        records = await asyncio.to_thread(member_records, a.status(), n, max(honest))  # before either phase's clock
        await asyncio.sleep(3)  # start-up allocations settle
        rows = []
        for name, recs in (("unattacked", []), ("flooded", records)):
            rows.append(await members_phase(swarm, a, b, name, recs))
            print(f"  members {name}: done in {rows[-1]['seconds']:.0f} s", flush=True)
        return rows
    finally:
        await asyncio.to_thread(swarm.close)


def print_members(rows: list[dict]) -> None:
    print(f"\nMembers key (issue 80): admitted member records stored at node a of a 2-node swarm by a stranger; a "
          f"newcomer starts in each phase ({WINDOW:.0f} s or the flood and 20 s, whichever is longer)")
    print(f"{'phase':10} | {'records':>7} | {'flood':>6} | {'newcomer found by a/b':>22} | {'b polls/timeouts':>16} | "
          f"{'b members':>9} | {'a evicted/refused':>17} | {'RSS growth MB a/b':>17}")
    for r in rows:
        found = "/".join(f"{r['found'][w]:.1f} s" if w in r["found"] else "LOST" for w in ("a", "b"))
        print(f"{r['phase']:10} | {r['records']:>7} | {r['flood_s']:>5.1f}s | {found:>22} | "
              f"{'%d/%d' % (r['polls'], r['timeouts']):>16} | {r['members_b']:>9} | "
              f"{'%d/%d' % (r['evicted'], r['refused']):>17} | {'/'.join(f'{g:.0f}' for g in r['growth']):>17}")
    print("newcomer: from its start to its being discovered (a DHT record or a hello) by a and by b; b polls: "
          "member polls b completed in the phase (each asks for every record under the key), timeouts: those "
          "that gave no answer; b members: the members b has discovered at the end (the flood's admitted "
          "records count: they are valid members to b); a evicted/refused: strangers' records a's members key "
          "made room for or refused; growth: peak RSS over before. Goals: polls go on, the newcomer found, "
          "growth <= 64 MB")


# ------------------------------------------------------------------ closed swarm
async def read_as(a, key: Identity, attempts: int, started: asyncio.Event) -> dict:
    """``attempts`` syncs of ``a``'s state as ``key`` (entries, then every named author's ops), each on its own
    stream (``started`` set after the first); then a pubsub subscription. Counts what came back, and whether ``a``
    kept the pubsub stream open (a member's stays open, quiet: a's own SUB goes on a's outbound stream)."""
    from swarmd.protocols.gossip import PUBSUB_SPEC, SUB

    got = {"syncs_ok": 0, "ops": 0, "private": False, "refused": 0, "sub_ok": 0}
    t = P2PDaemonTransport(key, P2PDaemonConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
    await t.start()
    try:
        await t.connect(a.tcp_addr)
        for _ in range(attempts):
            try:
                async with await t.open_stream(a.peer_id, CRDT_SPEC, timeout=10) as stream:
                    await stream.send(SYNC, {"d": [], "after": None})
                    entries = (await asyncio.wait_for(stream.read_required(), 10)).body
                    await stream.send(WANT, {"have": {author: 0 for author in entries["vv"]}})
                    ops = (await asyncio.wait_for(stream.read_required(), 10)).body["ops"]
                got["syncs_ok"] += 1
                got["ops"] += len(ops)
                got["private"] |= any(b"private" in w["b"] for w in ops)
            except Exception:  # noqa: BLE001 - a refusal is what is counted
                got["refused"] += 1
            started.set()
        try:
            async with await t.open_stream(a.peer_id, PUBSUB_SPEC, timeout=10) as stream:
                await stream.send(SUB, ["swarmd/any"])
                await asyncio.wait_for(stream.read_required(), 8)
                got["sub_ok"] += 1  # a said something: open
        except asyncio.TimeoutError:
            got["sub_ok"] += 1  # open and quiet
        except Exception:  # noqa: BLE001 - closed by a: refused
            pass
    finally:
        started.set()
        await t.close()
    return got


def write_reaches(a, b, key: str) -> float | None:
    t0 = time.monotonic()
    http_post(a.url + "/crdt", json_body={"ops": [{"object": "kv", "payload": {"k": f"{a.peer_id}/{key}",
                                                                                 "v": key}}]})
    try:
        wait_for(lambda: http_get(b.url + "/state")["objects"]["kv"].get(f"{a.peer_id}/{key}") == key, 30,
                 "the member's write", 0.02)
    except AssertionError:
        return None
    return time.monotonic() - t0


async def part_closed(tmp: Path) -> list[dict]:
    root, reader = tmp / "closed", Identity.generate()
    keys = []
    for name in ("n0", "n1"):
        (root / name).mkdir(parents=True)
        keys.append(Identity.load_or_create(root / name / "identity.key")[0].peer_id)
    allow = ", ".join(f'"{k}"' for k in keys + [reader.peer_id])
    config = tmp / "closed.toml"
    text = local_config(tmp, BITS).read_text()
    config.write_text(text.replace("[state]\n", f"[state]\nallow = [{allow}]\n", 1))
    swarm = Swarm(root, config=config)
    try:
        a, b = await asyncio.to_thread(swarm.start_chain, 2)
        await asyncio.to_thread(http_post, a.url + "/crdt", json_body={"ops": [
            {"object": "kv", "payload": {"k": f"{a.peer_id}/secret", "v": "private"}}]})
        await asyncio.sleep(3)
        rows = []
        for phase, readers in (("member reads", [reader]), ("outsiders", [Identity.generate()
                                                                          for _ in range(OUTSIDERS)])):
            before = a.status()
            rss = RssPeaks([a])
            t0 = time.monotonic()
            started = asyncio.Event()
            reads = asyncio.gather(*(read_as(a, k, ATTEMPTS // len(readers), started) for k in readers))
            await started.wait()  # the write goes while the reads go on
            write = await asyncio.to_thread(write_reaches, a, b, phase.replace(" ", "-"))
            got = await reads
            after = a.status()
            rows.append({"phase": phase, "keys": len(readers), "syncs": sum(g["syncs_ok"] + g["refused"] for g in got),
                         "syncs_ok": sum(g["syncs_ok"] for g in got), "ops": sum(g["ops"] for g in got),
                         "private": any(g["private"] for g in got), "subs_ok": sum(g["sub_ok"] for g in got),
                         "refused": sum(after["errors"].get(k, 0) - before["errors"].get(k, 0)
                                        for k in ("crdt_not_member", "pubsub_not_member")),
                         "write": write, "growth": rss.stop()[0], "seconds": time.monotonic() - t0})
            print(f"  closed {phase}: done in {rows[-1]['seconds']:.0f} s", flush=True)
        return rows
    finally:
        await asyncio.to_thread(swarm.close)


def print_closed(rows: list[dict]) -> None:
    print("\nClosed swarm (issue 80): a's state read by a reader on the allowlist, then by fresh keys outside it; "
          "a member's write from a to b meanwhile")
    print(f"{'phase':12} | {'keys':>4} | {'syncs ok/asked':>14} | {'ops received':>12} | {'private value':>13} | "
          f"{'pubsub open':>11} | {'a refused':>9} | {'write a->b':>10} | {'RSS growth':>10}")
    for r in rows:
        write = "LOST" if r["write"] is None else f"{r['write'] * 1e3:.0f} ms"
        print(f"{r['phase']:12} | {r['keys']:>4} | {'%d/%d' % (r['syncs_ok'], r['syncs']):>14} | {r['ops']:>12} | "
              f"{'read' if r['private'] else 'not read':>13} | {r['subs_ok']:>11} | {r['refused']:>9} | "
              f"{write:>10} | {r['growth']:>8.0f}MB")
    print("syncs: a member's sync (entries, then every author's ops), each on its own stream; pubsub open: "
          "pubsub streams a kept open after a SUB (it closes an outsider's); a refused: crdt_not_member + "
          "pubsub_not_member a counted; write: a's write "
          "read at b. Goals: outsiders read nothing, members read everything, the write unaffected")

