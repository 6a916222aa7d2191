"""``swarmd doctor``'s verdict, computed from a node's ``/status`` (pure: the CLI prints it, the dashboard shows
it, tests call it on a status they make up)."""

from __future__ import annotations


# what each cause of a failed hole punch means and what the user can do (node.nat classifies them)
FORWARD = ("forward a TCP port on the router to this node and start with --announce /ip4/<public ip>/tcp/<port>, "
           "or turn on port mapping (network.port_mapping = true) if the router speaks UPnP / NAT-PMP")
PUNCH_CAUSES = {
    "our-mapping": "this node's NAT gives each destination its own port (a symmetric NAT): no peer can aim one "
                   "connection at it; a burst of many at once reaches peers whose NAT keeps the port (most of the "
                   "time, once per peer every 5 minutes), never peers behind another symmetric NAT; " + FORWARD,
    "their-mapping": "the peer's NAT changes the port (symmetric): no single connection can aim at it; a burst of "
                     "many at once gets through where our NAT keeps the port (most of the time, once per "
                     "peer every 5 minutes); for a sure path the peer (or this node) can "
                     + FORWARD.replace("this node", "it"),
    "closed": "the hole-punched connection closed while it was handed to the p2p daemon, again on the attempts made "
              "at once after it: a firewall or NAT that resets new connections, or a peer that restarted",
    "timeout": "no packet got through although both NATs keep the port: a firewall or NAT that filters inbound "
               "connections even after ours went out (or drops unsolicited SYNs with a long delay); " + FORWARD,
}


def punch_hints(nat: dict, relayed: list[str]) -> list[str]:
    """Why the last hole punches failed, one hint per cause, and what to do."""
    failed = {}
    for p in nat.get("punches", []):
        if not p.get("ok"):
            failed.setdefault(p.get("cause") or "timeout", []).append(p["peer"][-8:] if p.get("peer") else "?")
    if nat.get("mapping") in ("changed", "varies") and relayed:
        failed.setdefault("our-mapping", [])
    hints = []
    for cause, peers in failed.items():
        who = f" (last with {', '.join(dict.fromkeys(peers))})" if peers else ""
        hints.append(f"hole punching failed{who}: {PUNCH_CAUSES.get(cause, cause)}; the relay keeps working")
    if not hints and nat.get("punch_attempts", 0) and not nat.get("punch_successes", 0):
        hints.append("hole punching has not succeeded yet; the relay keeps working")
    return hints


def _ids(peers) -> str:
    """A few peers by the last 8 characters of their ids."""
    return ", ".join(p[-8:] for p in sorted(peers)[:3]) + ("..." if len(peers) > 3 else "")


def diagnose(s: dict) -> dict:
    """A doctor's report from a node's /status (pure: tested on its own)."""
    nat = s.get("services", {}).get("nat", {})
    peers = [p for p in s["peers"] if p["connected"]]
    direct = [p for p in peers if p["path"] in ("direct", "hole-punched")]
    punched = [p for p in peers if p["path"] == "hole-punched"]
    relayed = [p for p in peers if p["path"] == "relayed"]
    unconnected = [p for p in s["peers"] if p["member"] and not p["connected"]]
    observed = nat.get("observed_addrs", [])
    local_ips = {a.split("/")[2] for a in s.get("addresses", []) if a.startswith(("/ip4/", "/ip6/"))}
    observed_ips = {a.split("/")[2] for a in observed}
    listen_ports = {a.split("/")[4] for a in s.get("listen", []) if "/tcp/" in a}
    if not observed:
        nat_text = "unknown (no peer has answered an AutoNAT probe yet)"
    elif observed_ips <= local_ips:
        nat_text = "none seen: peers see this node at one of its own addresses"
    else:
        kept = {a.split("/")[4] for a in observed} & listen_ports
        nat_text = (f"translated: this node's addresses are {', '.join(sorted(local_ips - {'127.0.0.1'})) or '-'}, "
                    f"peers see {', '.join(sorted(observed_ips))}"
                    + ("; the listen port is kept (endpoint-independent mapping likely: hole punching can work)"
                       if kept else "; the port changes (a symmetric NAT likely: hole punching only by bursts of many "
                       "connections, to peers whose NAT keeps the port)"))
    punches = nat.get("punches", [])
    last = punches[0] if punches else None
    punch = (f"{nat.get('punch_successes', 0)} of {nat.get('punch_attempts', 0)} attempts succeeded"
             + (f" (and {nat.get('punch_served_ok', 0)} of {nat.get('punch_served', 0)} that peers started)"
                if nat.get("punch_served") else "")
             + ("" if last is None else "; last: ok" if last["ok"] else
                f"; last: failed ({last.get('cause', 'error')}: {last.get('error')})"))
    hints = []
    reach = s["reachability"]
    if not s["peers"] and not s.get("bootstrap"):
        hints.append("no peers and no bootstrap: start with --bootstrap <address of a running node> to join a swarm")
    for b in s.get("bootstrap", []):
        if b["state"] != "connected":
            hints.append(f"bootstrap {b['addr']} is not connected ({b.get('last_error') or 'retrying'}): check the "
                         "address, that the node runs, and that its port is open to you")
    if reach == "private" and not nat.get("relays"):
        hints.append("this node is behind a NAT and has no relay: set network.relays or bootstrap from a public "
                     "node, or forward a port and announce it (--announce /ip4/<public ip>/tcp/<port>)")
    if reach == "private" and nat.get("relays") and not any(p in direct and p["peer_id"] in
                                                           " ".join(nat["relays"]) for p in peers):
        hints.append("no connection to any relay: others cannot reach this node until one is connected")
    if reach == "unknown" and s["peers"]:
        hints.append("reachability unknown: no directly connected peer has answered an AutoNAT probe yet")
    if relayed:
        hints.append(f"{len(relayed)} peer(s) only through a relay: control traffic works, bulk transfers go "
                     "through peers with a direct path; forwarding a port (or port_mapping = true) makes this "
                     "node directly reachable")
    hints += punch_hints(nat, [p["peer_id"] for p in relayed])
    split = s.get("split") or {}
    if split.get("suspected"):
        hints.append(f"split: {split['lost']} of the {split['known']} members this node knows are reached neither "
                     f"by it nor by its neighbours (for {split.get('seconds')} s); it re-dials them at their "
                     "remembered addresses. A partition or a firewall between groups of peers does this; check "
                     "the links between them")
    if unconnected:
        hints.append(f"{len(unconnected)} member(s) not connected: they may be offline, or behind NATs with no "
                     "relay in common")
    crdt = s.get("crdt") or {}
    refused = crdt.get("refused_by") or {}
    writes = {"refused_by": {p: v.get("ops", 0) for p, v in sorted(refused.items())},
              "refused_ops": sum(v.get("ops", 0) for v in refused.values()),
              "paused": bool(crdt.get("writes_paused"))}
    if refused:
        hints.append(f"{len(refused)} peer(s) refused {writes['refused_ops']} of this node's own writes, so they do "
                     f"not reach the swarm ({', '.join(sorted(refused)[:3])}{'...' if len(refused) > 3 else ''}): "
                     "check that every node runs the same swarmd version with the same node.swarm, "
                     "state.admission_bits and state.allow, that this machine's clock is right, and the peers' logs")
    if writes["paused"]:
        hints.append("writes are paused: the op log was damaged and this node is re-fetching its own ops from a "
                     "peer (it writes again once one answers, or after 2 minutes alone)")
    training = []
    for name, svc in sorted(s.get("services", {}).items()):
        paths = svc.get("reach")
        if not isinstance(paths, dict) or not paths.get("rounds_closed"):
            continue
        ours, closed, through = paths["rounds_with_our_update"], paths["rounds_closed"], paths["through_members"]
        around, idle = paths.get("reduced_by_members") or {}, paths.get("rounds_not_reducing", 0)
        training.append(f"{name}: this node's update was in {ours} of {closed} rounds"
                        + (f"; {len(through)} peer(s) without a direct path, their updates "
                           f"{paths.get('via', 'pulled')} through members ({_ids(through)})" if through else "")
                        + (f"; {len(around)} peer(s) without a direct path, their chunks reduced by members that "
                           f"reach both ({_ids(around)})" if around else "")
                        + (f"; this node reduced no part in {idle} round(s), lacking a direct path to a member"
                           if idle else ""))
        if closed - ours > closed // 4:
            hints.append(f"{name}: this node's update was left out of {closed - ours} of {closed} rounds: its "
                         "uplink may be too slow for the round deadline (see transfer_rate_bps and deadline_s), or "
                         "no member with a direct path to it was in those rounds")
    for name, svc in sorted(s.get("services", {}).items()):
        if svc.get("state") == "refused":
            hints.append(f"{name} refused: {svc.get('refused')}")
        elif svc.get("state") == "failed":
            hints.append(f"{name} failed: {svc.get('error')}")
    return {
        "reachability": reach,
        "reachability_source": "forced by config" if nat.get("detected") != reach else "AutoNAT",
        "observed_addrs": observed,
        "nat": nat_text,
        "relays": nat.get("relays", []),
        "relay_service": nat.get("relay_service", False),
        "punch": punch,
        "direct": len(direct),
        "punched": len(punched),
        "relayed": len(relayed),
        "unconnected": len(unconnected),
        "peers": [{"peer_id": p["peer_id"], "path": p["path"], "relay": p["relay"], "since": p["path_since"]}
                  for p in peers],
        "split": {k: split.get(k) for k in ("suspected", "lost", "known", "seconds", "last_split")},
        "writes": writes,
        "training": training,
        "hints": hints,
    }
