"""Member poll benchmark: what reading the members key costs a node as the swarm grows.

Every node reads the swarm's members key from the DHT (``Discovery.poll``), and the answer holds every member's
signed record (up to 10,000). Here one process runs the key's replicas (``--replicas``, 5: a node stores its
record on hivemind's ``num_replicas`` nearest nodes, and a poll reads every one of them), DHT nodes on real p2p
daemons that each hold M member records signed by their own keys, and another process runs a real
:class:`~dht.discovery.Discovery` that polls them through the DHT.
Between two polls, the share of members that a node's ``refresh_interval`` (20 s) would have re-stored in its
``Discovery.poll_every()`` re-store their records: the same value, re-signed with a later expiry.

Measured per poll: the polling process's CPU (Python; its p2p daemon is not counted), and the storing process's CPU
for the same poll, once with the current code and once with the baseline (a poll every 5 s whatever the swarm's size,
each record's signature and value checked in full and parsed again by the poll at every poll: the validator's
``remember=0`` and the poll's memory of the last records emptied before each poll). The two alternate poll by poll
against the same DHT, so the ratio is measured under the same load. "Share of a core" is a poll's CPU over the
interval between polls.

    python bench/bench_members.py [--members 100 1000 5000] [--polls 6] [--replicas 5]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REFRESH = 20.0  # discovery.refresh_interval's default: each member re-stores its record this often
BEFORE_EVERY = 5.0  # the baseline's poll interval, whatever the swarm's size


def _signer_for(identities):
    """A validator that signs each record as the member its subkey names: M members stored from one process."""
    from swarmd.dht.records import Ed25519RecordValidator, member_value_ok

    class Signer(Ed25519RecordValidator):
        def __init__(self, key: str, members: dict):
            super().__init__(next(iter(members.values())), {key: member_value_ok})
            self._members = {m.peer_id.encode(): m for m in members.values()}

        def sign_value(self, record) -> bytes:
            tag = record.subkey or b""
            start = tag.find(b"[owner:ed25519:")
            owner = self._members.get(tag[start + 15: tag.find(b"]", start)]) if start >= 0 else None
            if owner is None:
                return record.value
            return record.value + b"[ed25519sig:" + __import__("base64").b64encode(
                owner.sign(self._signed_bytes(record))) + b"]"

    return Signer


def _serve(members: int, replicas: int, conn) -> None:
    """The key's storing nodes: ``replicas`` DHT nodes, each on its own p2p daemon, each holding ``members`` signed
    member records (a node stores its record on 5, hivemind's ``num_replicas``, and a poll asks each of them)."""
    import random

    import uvloop

    from swarmd.dht.records import NodeRecord, owner_tag
    from swarmd.transport._compat import load_hivemind
    from swarmd.transport.identity import Identity
    from swarmd.transport.p2pd import P2PDaemonConfig, P2PDaemonTransport

    hm = load_hivemind()
    from hivemind.dht.routing import DHTID

    async def main() -> None:
        import resource

        key = "swarmd/bench/members"
        identities = {i: Identity.generate() for i in range(members)}
        signer = _signer_for(identities)(key, identities)
        transports, nodes = [], []
        for _ in range(replicas):  # the key's replicas: each holds every record, and a poll reads each of them
            transport = P2PDaemonTransport(Identity.generate(), P2PDaemonConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
            await transport.start()
            transports.append(transport)
            nodes.append(await hm.DHTNode.create(p2p=transport.hivemind_p2p, record_validator=signer,
                                                 num_replicas=1))
        serializer = nodes[0].protocol.serializer

        async def store(which) -> None:
            records = {i: NodeRecord(identities[i].peer_id, (f"/ip4/10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}/tcp/"
                                                              f"4001/p2p/{identities[i].peer_id}",),
                                     "0.1.0", ("diloco",), 1.0, "ab" * 8).to_wire() for i in which}
            expiration = hm.get_dht_time() + 120
            key_id = DHTID.generate(source=key)
            for i, wire in records.items():  # into each replica's storage, signed as the DHT's store would sign it
                tag = owner_tag(identities[i].peer_id)  # kept as it is, signed serialized (hivemind's rpc_store)
                signed = signer.sign_value(hm.DHTRecord(
                    key_id.to_bytes(), serializer.dumps(tag), serializer.dumps(wire), expiration))
                for node in nodes:
                    node.protocol.storage.store_subkey(key_id, tag, signed, expiration)

        await store(list(identities))
        conn.send((key, [(await t.addresses())[0] for t in transports]))
        while True:
            command = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
            if command == "stop":
                break
            if isinstance(command, tuple) and command[0] == "churn":
                # a refresh: the same value, re-signed with a later expiry (Discovery.my_record)
                await store(random.sample(list(identities), int(members * command[1])))
            conn.send(resource.getrusage(resource.RUSAGE_SELF))
        for node, transport in zip(nodes, transports):
            await node.shutdown()
            await transport.close()

    uvloop.run(main())


def _cpu(usage) -> float:
    return usage.ru_utime + usage.ru_stime


async def _measure(members: int, replicas: int, polls: int) -> dict:
    from swarmd.dht.discovery import Discovery, DiscoveryConfig
    from swarmd.transport._compat import load_hivemind
    from swarmd.transport.identity import Identity
    from swarmd.transport.p2pd import P2PDaemonConfig, P2PDaemonTransport

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(members, replicas, theirs), daemon=True)
    server.start()
    try:
        key, addrs = await asyncio.get_running_loop().run_in_executor(None, ours.recv)
        transport = P2PDaemonTransport(Identity.generate(), P2PDaemonConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
        await transport.start()
        discovery = Discovery(transport, transport.identity, DiscoveryConfig("bench", addrs, max_peers=0),
                              version="bench")
        await discovery.start()
        assert discovery.members_key == key
        hm = load_hivemind()
        for addr in addrs:  # into each other's routing tables (no hello: the storing nodes are bare DHT nodes)
            peer_id = await transport.connect(addr, timeout=10)
            if await discovery.dht.protocol.call_ping(hm.PeerID.from_base58(peer_id), validate=False) is None:
                raise RuntimeError("a storing node did not answer a DHT ping")
        discovery.members = dict.fromkeys(range(members))  # what a node of this swarm knows: its poll interval
        every = discovery.poll_every()
        discovery.members = {}
        churn = min(1.0, every / REFRESH)  # the share of records re-stored between two of its polls
        rows: dict[str, list] = {"before": [], "now": []}
        for i in range(2 * polls + 2):
            mode = "now" if i % 2 == 0 else "before"
            if mode == "now":  # re-stored before each pair: each "now" poll reads that share changed
                await _ask(ours, ("churn", churn))
            discovery.validator._remember = 0 if mode == "before" else 20_000
            if mode == "before":
                discovery._parsed = {}
            serving = _cpu(await _ask(ours, "cpu"))
            cpu, wall = time.process_time(), time.perf_counter()
            await discovery.poll()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            serving = _cpu(await _ask(ours, "cpu")) - serving
            if len(discovery.members) != members:
                raise RuntimeError(f"a poll saw {len(discovery.members)} of {members} members")
            if i >= 2:  # the first two fill what the new code remembers, and warm both paths
                rows[mode].append((cpu, wall, serving))
        checks = dict(discovery.validator.checks)
        await discovery.close()
        await transport.close()
        return {"members": members, "checks": checks, "every": every, "churn": churn,
                **{mode: [statistics.median(r[k] for r in rs) for k in range(3)] for mode, rs in rows.items()}}
    finally:
        ours.send("stop")
        server.join(30)
        if server.is_alive():
            server.kill()


async def _ask(conn, command):
    conn.send(command)
    return await asyncio.get_running_loop().run_in_executor(None, conn.recv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, nargs="+", default=[100, 1000, 5000])
    parser.add_argument("--polls", type=int, default=6, help="polls measured per mode (alternated)")
    parser.add_argument("--replicas", type=int, default=5, help="the nodes that store the members key (hivemind's "
                        "num_replicas, as discovery stores it)")
    args = parser.parse_args()
    import uvloop

    results = [uvloop.run(_measure(m, args.replicas, args.polls)) for m in args.members]
    print(f"# bench_members {datetime.datetime.now().isoformat(timespec='seconds')}: median of {args.polls} polls per "
          f"mode; the key on {args.replicas} storing nodes; before: a poll every {BEFORE_EVERY:.0f} s, every record "
          f"checked and parsed; now: a poll every "
          f"poll_every() s, the records re-stored since the poll before ({REFRESH:.0f} s refresh) checked")
    print("members | poll every s, before | now  | re-stored | poll CPU ms, before | now    | "
          "share of a core, before | now    | ratio | serving CPU ms a poll, before | now")
    for r in results:
        (b_cpu, b_wall, b_srv), (n_cpu, n_wall, n_srv) = r["before"], r["now"]
        b_share, n_share = b_cpu / BEFORE_EVERY, n_cpu / r["every"]
        print(f"{r['members']:7d} | {BEFORE_EVERY:20.1f} | {r['every']:4.1f} | {r['churn']:9.0%} | "
              f"{b_cpu * 1e3:19.1f} | {n_cpu * 1e3:6.1f} | {b_share:23.1%} | {n_share:6.1%} | "
              f"{n_share / b_share:5.2f} | {b_srv * 1e3:29.1f} | {n_srv * 1e3:.1f}")
        print(f"        validator checks over the run: {r['checks']}; poll wall ms before {b_wall * 1e3:.0f}, "
              f"now {n_wall * 1e3:.0f}")


if __name__ == "__main__":
    main()
