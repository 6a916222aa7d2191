"""SAPO's rounds, the loop's own code, in one process on virtual time (node/sim.py SapoSim): sharing among four
peers, a poisoner whose items are re-scored by everyone's verifier, a peer killed mid-run. Seconds each;
test_sapo.py's multi-process tests stay as the end-to-end layer."""

import random

import pytest

from swarmd.node.sim import ChurnConfig, SapoSim, SimConfig
from swarmd.protocols import sapo
from swarmd.transport.memory import run_virtual

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)


def _sim(tmp_path, peers: int, rounds: int = 10, **settings) -> SapoSim:
    return SapoSim(SimConfig(peers=peers, seed=3), ChurnConfig(rounds=rounds), tmp_path, **settings)


def poisons(event, comps: list[list[str]]) -> list[list[str]]:
    """Shares the same wrong answer for every completion of every question (SAPO's ``share`` phase)."""
    return [["999"] * len(c) for c in comps]


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
        assert len([a for a, s in lp.sources.by_peer.items() if s.items > 0 and a != lp.sources.me]) == 3  # every
        # other peer's items were scored
        assert lp.counters.get("ignored_rate", 0) == 0 and lp.counters.get("rejected_malformed", 0) == 0
    assert sum(lp.counters["items_used_external"] for lp in loops) > 0


@pytest.mark.timeout(120)
def test_a_poisoners_items_are_rescored_and_never_used(tmp_path):
    async def main():
        sim = _sim(tmp_path, 4)
        poisoner = sim.peers[0]
        sim.faults.alter("share", poisons, peer=poisoner)
        async with sim:
            await sim.start_all()
            await sim.until(sim.finished, 300, "everyone to finish")
            return poisoner, [sim.loop(p) for p in sim.peers[1:]]

    poisoner, honest = run_virtual(main())
    for lp in honest:
        s = lp.sources.by_peer[poisoner]
        assert s.items > 0 and s.reward == 0 and s.used == 0  # our verifier's reward, not its claim; no advantage
        assert lp.state == "done"


def oracle(accuracy: float):
    """A policy that answers right with probability ``accuracy`` (its own rollouts and what it shares; SAPO's
    ``rollouts`` phase): an honest peer of a known strength, so the test does not wait for a tiny policy to learn."""

    def answers(event, rolled: tuple) -> tuple:
        lp, q_seed, specs = event.loop, event.info["q_seed"], event.info["specs"]
        rng = random.Random(f"{accuracy}/{q_seed}")
        questions = [sapo.question(lp.task, d, q_seed, k) for d, k in specs]
        comps = [[q.answer if rng.random() < accuracy else f"{(int(q.answer) + 1) % 100:02d}"
                  for _ in range(lp.cfg.completions)]
                 for q in questions]
        return [sapo.score(lp.task, d, q_seed, k, c) for (d, k), c in zip(specs, comps)], comps

    return answers


@pytest.mark.timeout(120)
def test_a_source_that_never_scores_is_penalised_as_useless_and_honest_ones_never_are(tmp_path):
    """Honest peers answering right 50%, 30% and 15% of the time (the weakest still above a quarter of the
    median), and one whose answers are all wrong: every honest peer judges it useless within a few rounds
    (rounds.Sources), penalises it a few times (not every round) and shows it; none judges an honest one."""
    async def main():
        sim = _sim(tmp_path, 4, rounds=24, questions=8, completions=4)
        poisoner = sim.peers[0]
        sim.faults.alter("share", poisons, peer=poisoner)
        for peer, accuracy in zip(sim.peers[1:], [0.5, 0.3, 0.15]):
            sim.faults.alter("rollouts", oracle(accuracy), peer=peer)
        async with sim:
            await sim.start_all()
            await sim.until(sim.finished, 300, "everyone to finish")
            return poisoner, [sim.loop(p) for p in sim.peers[1:]], sim

    poisoner, honest, sim = run_virtual(main())
    for lp in honest:
        status = lp.status()
        assert set(status["offenders"]) == {poisoner}, status["offenders"]
        assert 1 <= status["offenders"][poisoner]["refused"]["useless"] <= 3  # its streak doubled at most twice
        assert status["sources"][poisoner]["useless"] and status["sources"][poisoner]["reward"] == 0.0
        assert not any(v["useless"] for p, v in status["sources"].items() if p != poisoner)
        assert lp._ctx.transport.penalties.offences(poisoner).get("suspect", 0) >= 1


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


@pytest.mark.timeout(120)
def test_a_peer_restarted_after_sharing_rounds_past_its_checkpoint_never_shares_one_of_them_again(tmp_path):
    """kill -9 after sharing a round its checkpoint does not have (checkpoints every 2 rounds): the restart goes on
    after the last round it shared (a marker in the data dir), so nobody sees two item sets for one round of it
    (equivocation: refused and penalised; 30 times in 40 restarts of the kill bench, before)."""
    async def main():
        sim = _sim(tmp_path, 4, rounds=14)
        victim = sim.peers[3]
        async with sim:
            await sim.start_all()

            def past_a_checkpoint_and_seen():
                # an odd round it shared (all hold its items), not trained yet: its checkpoint is at the round before
                r = sim.loop(victim).round
                return r >= 5 and r % 2 == 1 and all(sim.loop(p).inbox.get(victim, (-1,))[0] == r
                                                     for p in sim.peers[:3])

            await sim.until(past_a_checkpoint_and_seen, 120, "the victim past a checkpoint, its items everywhere")
            shared = sim.loop(victim).round
            await sim.kill(victim)
            await sim.start(victim, restart=True)
            await sim.until(lambda: all(sim.loop(p).state == "done" for p in sim.peers), 300, "everyone")
            return shared, sim.loop(victim), [sim.loop(p) for p in sim.peers[:3]]

    shared, victim, survivors = run_virtual(main())
    assert victim.resumed["round"] == shared - 1  # its checkpoint: the round before the one it shared last
    assert victim.joined_at == shared + 1 and victim.counters["rounds_skipped_after_restart"] == 1
    assert all(lp.counters.get("equivocation", 0) == 0 for lp in survivors)


@pytest.mark.timeout(120)
def test_two_peers_without_a_direct_path_to_each_other_start_together_and_score_each_others_items(tmp_path):
    """Four peers, the last two listing each other as reached through a relay only (two peers behind symmetric
    NATs). Their completions are signed pubsub messages, which the mesh carries through the members: all four start
    together, each scores the items of the three others in every round, and ``reach`` says which peers came
    without a direct path. Before, only directly connected peers counted at the start: the two waited for a
    fourth peer that never came, and the run never began for them."""
    sim = _sim(tmp_path, 4, rounds=6)
    a, b = sim.peers[2:]
    sim.net.relay(a, b)
    sim.net.relay(b, a)
    loops = sim.run_to_end()
    for lp in loops:
        assert lp.state == "done" and lp.round == 6 and lp.joined_at == 0
        assert len([p for p, s in lp.sources.by_peer.items() if s.items > 0 and p != lp.sources.me]) == 3
        reach = lp.status()["reach"]
        assert reach["rounds_with_our_update"] == reach["rounds_closed"] == 6, reach
    for lp, other in ((loops[2], b), (loops[3], a)):
        through = lp.status()["reach"]["through_members"]
        assert set(through) == {other} and through[other] >= 5, through  # a round may close before its items come
        assert lp.sources.by_peer[other].items >= 5 * 4
    for lp in loops[:2]:
        assert lp.status()["reach"]["through_members"] == {}
