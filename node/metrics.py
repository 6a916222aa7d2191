"""Prometheus metrics, read from the node's state at scrape time (one registry per node, no globals)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from swarmd.node import __version__

if TYPE_CHECKING:
    from swarmd.node.core import Node

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class NodeCollector:
    def __init__(self, node: Node):
        self.node = node

    def collect(self):
        node = self.node
        stats = node.transport.stats
        yield InfoMetricFamily("swarmd", "swarmd build and identity",
                               value={"version": __version__, "peer_id": node.identity.peer_id,
                                      "swarm": node.config.node.swarm})
        yield GaugeMetricFamily("swarmd_uptime_seconds", "Seconds since the node started", value=node.uptime())

        lag = node.loop_lag.view()
        yield GaugeMetricFamily("swarmd_event_loop_lag_seconds", "The event loop's largest timer lag over the last "
                                "minute", value=lag["lag_ms_max"] / 1e3)
        yield CounterMetricFamily("swarmd_event_loop_stalls", "Timer lags over 100 ms since start",
                                  value=lag["stalls"])
        peers = GaugeMetricFamily("swarmd_peers", "Peers by state", labels=["state"])
        peers.add_metric(["connected"], len(node.connected))
        peers.add_metric(["member"], len(node.discovery.members))
        peers.add_metric(["relayed"], sum(1 for c in node.connected.values() if c.path.value == "relayed"))
        peers.add_metric(["hole_punched"], sum(1 for c in node.connected.values() if c.path.value == "hole-punched"))
        peers.add_metric(["banned"], len(node.transport.penalties.banned()))
        yield peers

        reach = node.reach.view()
        yield GaugeMetricFamily("swarmd_split_suspected", "1 while this node reaches neither directly nor through "
                                "a neighbour at least 2 and a quarter of the members it knows",
                                value=int(reach["suspected"]))
        yield GaugeMetricFamily("swarmd_split_lost_members", "Known members reached neither by this node nor by "
                                "its neighbours", value=reach["lost"])
        yield CounterMetricFamily("swarmd_splits", "Splits detected", value=reach.get("splits", 0))
        yield CounterMetricFamily("swarmd_split_heals", "Splits healed", value=reach.get("heals", 0))
        redials = CounterMetricFamily("swarmd_split_redials", "Lost or remembered members re-dialled, by outcome",
                                      labels=["outcome"])
        redials.add_metric(["reached"], reach.get("redials_ok", 0))
        redials.add_metric(["failed"], reach.get("redials", 0) - reach.get("redials_ok", 0))
        yield redials
        yield GaugeMetricFamily("swarmd_dht_routing_table_size", "Peers in the DHT routing table",
                                value=node.discovery.routing_table_size())
        dht_ops = CounterMetricFamily("swarmd_dht_operations", "DHT and discovery operations", labels=["op"])
        for op, count in node.discovery.counters.items():
            dht_ops.add_metric([op], count)
        yield dht_ops
        if node.discovery.validator is not None:
            refused = CounterMetricFamily("swarmd_dht_records_refused", "DHT records our validator refused, by reason",
                                          labels=["reason"])
            for reason, count in node.discovery.validator.refused.items():
                refused.add_metric([reason], count)
            yield refused
            checked = CounterMetricFamily(
                "swarmd_dht_records_checked",
                "DHT records our validator checked: signature and value verified, or remembered from an earlier check",
                labels=["how"])
            for how, count in node.discovery.validator.checks.items():
                checked.add_metric([how], count)
            yield checked

        traffic = CounterMetricFamily("swarmd_bytes", "Bytes on swarmd protocol streams",
                                      labels=["protocol", "direction"])
        for proto, count in stats.bytes_in_by_protocol.items():
            traffic.add_metric([proto, "in"], count)
        for proto, count in stats.bytes_out_by_protocol.items():
            traffic.add_metric([proto, "out"], count)
        yield traffic

        messages = CounterMetricFamily("swarmd_messages", "Messages on swarmd protocol streams",
                                       labels=["protocol", "direction"])
        for proto, count in stats.messages_in.items():
            messages.add_metric([proto, "in"], count)
        for proto, count in stats.messages_out.items():
            messages.add_metric([proto, "out"], count)
        yield messages

        errors = CounterMetricFamily("swarmd_errors", "Errors by kind (malformed, oversized, ...)", labels=["kind"])
        for kind, count in stats.errors.items():
            errors.add_metric([kind], count)
        yield errors

        penalties = CounterMetricFamily("swarmd_peer_penalties", "Penalties given to peers by kind", labels=["kind"])
        for kind, count in node.transport.penalties.totals.items():
            penalties.add_metric([kind], count)
        yield penalties

        crdt = node.replicator.store
        yield GaugeMetricFamily("swarmd_crdt_ops", "Ops in the replicated state", value=len(crdt.ops))
        yield GaugeMetricFamily("swarmd_crdt_pending_ops", "Verified ops waiting for their author's previous op",
                                value=len(crdt.pending))
        yield CounterMetricFamily("swarmd_crdt_compacted_ops", "Ops dropped because their author's base restated them",
                                  value=crdt.compacted)
        yield GaugeMetricFamily("swarmd_crdt_log_records", "Records in the op log", value=node.replicator.log.records)
        yield GaugeMetricFamily("swarmd_crdt_heads", "Heads of the op DAG", value=len(crdt.heads))
        yield GaugeMetricFamily("swarmd_crdt_authors", "Authors merged into the replicated state",
                                value=len(crdt.chains))
        yield GaugeMetricFamily("swarmd_crdt_probation_authors", "Authors without standing held aside (bounded by "
                                "state.max_authors; the least recent gives way)", value=len(crdt.probation))
        probation = CounterMetricFamily("swarmd_crdt_probation", "Authors on probation: held, evicted (made room), "
                                        "merged (vouched for)", labels=["event"])
        for event, count in crdt.probation_counts.items():
            probation.add_metric([event], count)
        yield probation
        rejected = CounterMetricFamily("swarmd_crdt_rejected_ops", "Ops rejected by reason", labels=["reason"])
        for reason, count in crdt.rejected.items():
            rejected.add_metric([reason], count)
        yield rejected
        repl = CounterMetricFamily("swarmd_crdt_replication", "Replication events", labels=["event"])
        for event, count in node.replicator.counters.items():
            repl.add_metric([event], count)
        yield repl

        nat = node.nat
        punch = CounterMetricFamily("swarmd_hole_punch", "Hole punches to relayed peers (we start them)",
                                    labels=["result"])
        punch.add_metric(["attempt"], nat.counters["punch_attempts"])
        punch.add_metric(["success"], nat.counters["punch_successes"])
        yield punch
        failed = CounterMetricFamily("swarmd_hole_punch_failed", "Hole punches we started that failed, by cause "
                                     "(after the retries made at once)", labels=["cause"])
        for cause in ("closed", "our_mapping", "their_mapping", "timeout"):
            failed.add_metric([cause], nat.counters[f"punch_failed_{cause}"])
        yield failed
        answered = CounterMetricFamily("swarmd_hole_punch_answered", "Hole punches peers started with us",
                                       labels=["result"])
        answered.add_metric(["attempt"], nat.counters["punch_served"])
        answered.add_metric(["success"], nat.counters["punch_served_ok"])
        yield answered
        autonat = CounterMetricFamily("swarmd_autonat_dialbacks", "AutoNAT dial-backs others made to us",
                                      labels=["result"])
        autonat.add_metric(["ok"], nat.counters["dialbacks_ok"])
        autonat.add_metric(["failed"], nat.counters["dialbacks_failed"])
        yield autonat
        reach = GaugeMetricFamily("swarmd_reachability", "1 for the current reachability", labels=["reachability"])
        for r in ("public", "private", "unknown"):
            reach.add_metric([r], 1.0 if node.transport.reachability.value == r else 0.0)
        yield reach
        boot = GaugeMetricFamily("swarmd_bootstrap_connected", "1 if the bootstrap peer is connected", labels=["peer"])
        for b in node.discovery.bootstrap:
            boot.add_metric([b.peer_id], 1.0 if b.state == "connected" else 0.0)
        yield boot
        yield from loop_families(node)


# per training loop (labels loop, run), from each loop's loop_metrics(): (key, family name, help, counter?)
LOOP_SERIES = [
    ("round", "swarmd_loop_round", "The loop's current round (window for SPSA)", False),
    ("step", "swarmd_loop_step", "Inner steps this peer has taken", False),
    ("loss", "swarmd_loop_loss", "The loop's last loss (training or validation, as its status reports)", False),
    ("reward", "swarmd_loop_reward", "SAPO: mean reward of our own rollouts over the last 50 rounds", False),
    ("deadline_seconds", "swarmd_loop_deadline_seconds", "How long a round waits for its peers now", False),
    ("peers_in_last_round", "swarmd_loop_round_participants", "Peers whose contribution the last round used",
     False),
    ("running", "swarmd_loop_running", "1 while the loop trains (0 waiting, refused, failed or done)", False),
    ("bytes_sent", "swarmd_loop_bytes_sent", "Bytes of updates this loop sent", True),
    ("deadlines_missed", "swarmd_loop_deadlines_missed", "Rounds that closed at the deadline without a peer "
     "they waited for", True),
    ("peers_missed", "swarmd_loop_peers_missed", "Peers a round waited for and closed without, summed", True),
    ("task_mismatch", "swarmd_loop_task_mismatch", "Messages ignored as another task's (only those of peers with "
     "standing or a direct link to us can mark the loop refused)", True),
]


def loop_families(node: Node):
    loops = [(svc, svc.loop_metrics()) for svc in node.training_loops() if hasattr(svc, "loop_metrics")]
    for key, name, help_text, counter in LOOP_SERIES:
        family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, help_text, labels=["loop", "run"])
        for svc, values in loops:
            if values.get(key) is not None:
                family.add_metric(svc.loop_key.split("/", 1), float(values[key]))
        yield family


def make_registry(node: Node) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(node))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
