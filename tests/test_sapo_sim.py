"""SAPO's rounds, the loop's own code, in one process on virtual time (node/sim.py SapoSim): sharing among four
peers, a poisoner whose items are re-scored by everyone's verifier, a peer killed mid-run. Seconds each;
test_sapo.py's multi-process tests stay as the end-to-end layer."""

import pytest

from node.sim import ChurnConfig, SapoSim, SimConfig, _closing_after
from protocols import sapo
from transport.memory import run_virtual


def _sim(tmp_path, peers: int, rounds: int = 10, **settings) -> SapoSim:
    return SapoSim(SimConfig(peers=peers, seed=3), ChurnConfig(rounds=rounds), tmp_path, **settings)


class Poisoner(sapo.SapoLoop):
    """Shares the same wrong answer for every completion of every question."""

    def _publish(self, r, q_seed, specs, comps):
        super()._publish(r, q_seed, specs, [["999"] * len(c) for c in comps])


@pytest.mark.timeout(120)
def test_four_peers_share_and_score_each_others_items(tmp_path):
    async def main():
        sim = _sim(tmp_path, 4)
        async with sim:
            await sim.start_all()
            await sim.until(sim.finished, 300, "everyone to finish")
            return [sim.loop(p) for p in sim.peers]

    loops = run_virtual(main())
    for lp in loops:
        assert lp.state == "done" and lp.round == 10
        assert len([a for a, s in lp.sources.items() if s[0] > 0]) == 3  # every other peer's items were scored
        assert lp.counters.get("ignored_rate", 0) == 0 and lp.counters.get("rejected_malformed", 0) == 0
    assert sum(lp.counters["items_used_external"] for lp in loops) > 0


@pytest.mark.timeout(120)
def test_a_poisoners_items_are_rescored_and_never_used(tmp_path):
    async def main():
        sim = _sim(tmp_path, 4)
        poisoner = sim.peers[0]
        sim.classes[poisoner] = _closing_after(Poisoner, "_close_round", 1.0)  # as the honest ones: 10 x 0.1 s
        async with sim:
            await sim.start_all()
            await sim.until(sim.finished, 300, "everyone to finish")
            return poisoner, [sim.loop(p) for p in sim.peers[1:]]

    poisoner, honest = run_virtual(main())
    for lp in honest:
        scored, completions, reward, used = lp.sources[poisoner]
        assert scored > 0 and reward == 0 and used == 0  # our verifier's reward, not its claim; no advantage
        assert lp.state == "done"


@pytest.mark.timeout(120)
def test_a_killed_peer_costs_the_others_a_few_deadlines_not_every_round(tmp_path):
    async def main():
        sim = _sim(tmp_path, 4, rounds=16)
        victim = sim.peers[3]
        async with sim:
            await sim.start_all()
            await sim.until(lambda: sim.loop(victim).round >= 3, 120, "round 3")
            await sim.kill(victim)
            await sim.until(lambda: all(sim.loop(p).state == "done" for p in sim.peers[:3]), 300, "survivors")
            return [sim.loop(p).counters.get("deadline_missed", 0) for p in sim.peers[:3]]

    missed = run_virtual(main())
    assert all(1 <= m <= 6 for m in missed), missed  # it stops being waited for once it lost its standing
