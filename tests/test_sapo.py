"""SAPO: the task generator and verifier, wire validation, the GRPO step, and the loop across real node processes."""

import asyncio
import importlib.util
import tomllib
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from swarmd.protocols import arith
from swarmd.protocols.grpo import STOI, Group, Policy
from swarmd.protocols.sapo import ROLLOUTS, Rules, SapoConfig, parse_items, question_seed, score
from swarmd.protocols.task import TaskError, load
from hostile import HostilePeer
from swarmproc import Swarm, http_get, loop_config, run_cli, wait_for

RUN, SEED, AUTHOR = "t", 1, "12D3KooWAuthor"
ARITH = load("arith", {}, "sapo")
RULES = Rules(ARITH, SapoConfig(questions=64, completions=32))


@pytest.mark.beside
def test_questions_are_regenerated_exactly_and_answers_are_right():
    assert arith.question(7, 3) == arith.question(7, 3)
    assert len({arith.question(7, i).prompt for i in range(50)}) > 40
    for i in range(200):
        q = arith.question(11, i)
        task, a, b, c = arith.TASKS.index(q.prompt[0]), *map(int, q.prompt[1:4])
        expected = [a + b, (a * b) % 100, abs(a - b) + c, a + b + c][task]
        assert q.answer == f"{expected:02d}" and q.prompt.endswith("=")
        assert arith.reward(q, q.answer) == 1.0 and arith.reward(q, "xx") == 0.0


def items(round_=3, author=AUTHOR, n=2, comps=("12", "07")):
    q_seed = question_seed(RUN, SEED, author, round_)
    return {"r": round_, "items": [{"spec": ["arith", q_seed, k], "comps": list(comps)} for k in range(n)]}


@pytest.mark.beside
def test_rollout_messages_are_validated():
    r, parsed = parse_items(items(), run=RUN, seed=SEED, author=AUTHOR, rules=RULES)
    assert r == 3 and [i for _, i, _ in parsed] == [0, 1] and parsed[0][2] == ["12", "07"]

    def rejected(body, author=AUTHOR, rules=RULES):
        with pytest.raises(ValueError):
            parse_items(body, run=RUN, seed=SEED, author=author, rules=rules)

    rejected(items(), author="12D3KooWSomeoneElse")  # a spec that is not the sender's for this round
    forged = items()
    forged["r"] = 4  # replaying round 3's items as round 4's
    rejected(forged)
    dup = items()
    dup["items"][1]["spec"][2] = 0
    rejected(dup)
    other = items()
    other["items"][0]["spec"][0] = "chain_sum"  # not one of this run's datasets
    rejected(other)
    rejected(items(n=9), rules=Rules(ARITH, SapoConfig(questions=8)))  # more items than the run's questions
    q_seed = question_seed(RUN, SEED, AUTHOR, 3)
    for spec in (["arith", q_seed, -1], ["arith", q_seed, 64], ["arith", float(q_seed), 0], ["arith", q_seed],
                 ["arith", 1, q_seed, 0], "arith", ["arith", q_seed, 0, 0]):  # malformed specs
        rejected({"r": 3, "items": [{"spec": spec, "comps": ["12", "07"]}]})
    with_answer = items()
    with_answer["items"][0]["answer"] = "12"  # ground truth from the sender: never accepted
    rejected(with_answer)
    rejected(items(comps=("12",)))  # one completion has no advantage to compute
    rejected(items(comps=("1" * 17, "07")))  # over the length cap
    rejected(items(comps=("1\x00", "07")))  # outside the task's alphabet
    rejected(items(comps=(b"12", "07")))
    rejected(items(n=65))
    rejected({"r": -1, "items": []})
    rejected([3, []])


@pytest.mark.beside
def test_rewards_come_from_our_verifier_not_the_sender():
    q_seed = question_seed(RUN, SEED, AUTHOR, 0)
    q = arith.question(q_seed, 5)
    wrong = "99" if q.answer != "99" else "98"
    group = score(ARITH, "arith", q_seed, 5, [q.answer, wrong, wrong, q.answer])
    assert group.prompt == q.prompt and group.rewards == [1.0, 0.0, 0.0, 1.0] and group.informative
    assert not score(ARITH, "arith", q_seed, 5, [wrong] * 8).informative  # all wrong: dropped before training


@pytest.mark.beside
def test_reasoning_gym_questions_are_regenerated_and_scored_by_its_own_scorer():
    task = load("reasoning-gym", {}, "sapo")
    assert task.obj.datasets == ["chain_sum", "products"]
    q_seed = question_seed(RUN, SEED, AUTHOR, 2)
    for k in range(6):
        dataset = task.obj.datasets[k % 2]
        q, again = task.obj.question(dataset, q_seed, k), task.obj.question(dataset, q_seed, k)
        assert q.prompt == again.prompt and q.entry["answer"] == again.entry["answer"]
        group = score(task, dataset, q_seed, k, [q.entry["answer"], "x"])
        assert group.rewards[0] == 1.0 and group.rewards[1] < 1.0
    rules = Rules(task, SapoConfig())
    body = {"r": 2, "items": [{"spec": ["products", q_seed, 0], "comps": ["12", "-3"]}]}
    assert parse_items(body, run=RUN, seed=SEED, author=AUTHOR, rules=rules)[1][0][0] == "products"
    body["items"][0]["comps"] = ["12", "abc"]  # the policy writes digits and '-' only
    with pytest.raises(ValueError):
        parse_items(body, run=RUN, seed=SEED, author=AUTHOR, rules=rules)
    with pytest.raises(TaskError, match="unknown reasoning-gym datasets: nope"):
        load("reasoning-gym", {"datasets": ["nope"]}, "sapo")


@pytest.mark.beside
def test_grpo_step_raises_the_probability_of_rewarded_completions():
    torch.set_num_threads(1)
    policy = Policy(seed=3, d=32, layers=1, heads=2, lr=3e-3)
    q = arith.question(5, 0)
    wrong = "99" if q.answer != "99" else "98"

    def p_answer():
        with torch.no_grad():
            idx = torch.tensor([[STOI[c] for c in q.prompt + q.answer]])
            logp = torch.log_softmax(policy.model(idx[:, :-1]), -1)
            return float(logp[0, 4, idx[0, 5]] + logp[0, 5, idx[0, 6]])

    before = p_answer()
    flat = [p.detach().clone() for p in policy.model.parameters()]
    assert policy.step([Group(q.prompt, [wrong] * 4, [0.0] * 4)])["groups"] == 0  # nothing to learn
    assert all(torch.equal(a, b) for a, b in zip(flat, policy.model.parameters()))
    for _ in range(10):
        policy.step([Group(q.prompt, [q.answer, wrong, wrong, wrong], [1.0, 0.0, 0.0, 0.0])])
    assert p_answer() > before + 1.0
    completions = policy.generate([q.prompt], 64)
    assert len(completions) == 1 and len(completions[0]) == 64 and all(len(c) == 2 for c in completions[0])
    assert completions[0].count(q.answer) > 8


@pytest.mark.beside
def test_the_bench_compares_both_settings_on_the_same_questions(monkeypatch):
    """bench_sapo's 8/0 and 4/4 runs of a seed differ in I/J only: one run name and seed, so (with the same
    identities) every peer gets the same policy init and the same questions in every round of both."""
    benches = Path(__file__).parent.parent / "bench"
    monkeypatch.syspath_prepend(str(benches))
    spec = importlib.util.spec_from_file_location("bench_sapo", benches / "bench_sapo.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    base, shared = (SapoConfig(**tomllib.loads(bench.sapo_table(3, i, j, 60, 4, "hf-lm", bench.DATASETS["sparse"],
                                                                {"sft_steps": 10}))["loops"]["sapo"])
                    for i, j in ((8, 0), (4, 4)))
    assert (base.local, base.external, shared.local, shared.external) == (8, 0, 4, 4)
    assert base.model_dump(exclude={"local", "external"}) == shared.model_dump(exclude={"local", "external"})
    assert all(question_seed(base.run, base.seed, AUTHOR, r) == question_seed(shared.run, shared.seed, AUTHOR, r)
               for r in range(60))


@pytest.mark.beside
def test_config_is_checked(tmp_path):
    with pytest.raises(ValidationError):
        SapoConfig(local=9, questions=8)
    with pytest.raises(TaskError, match="multiple of heads"):
        load("arith", {"d": 30, "heads": 4}, "sapo")


# not `beside`: the CLI run imports torch (~3.5 s of CPU), which the niced worker may wait on for longer than a run's
# time limit while the real-time tests fill both cores
def test_the_cli_refuses_a_bad_loop_config(tmp_path):
    path = loop_config(tmp_path / "bad.toml", "[loops.sapo]\nlocal = 0\nexternal = 0\n")
    result = run_cli("start", "--config", str(path), "--data-dir", str(tmp_path / "d"))
    assert result.returncode == 2 and "invalid loops.sapo: " in result.stderr and "at least 1" in result.stderr


CONFIG = """
[loops.sapo]
run = "{run}"
rounds = {rounds}
min_peers = 3
deadline = 5.0
report_every = 5

[loops.sapo.task_options]
d = {d}
layers = {layers}
heads = {heads}
"""


def sapo(node) -> dict:
    return node.status()["services"]["sapo"]


@pytest.mark.swarm
@pytest.mark.timeout(240)
async def test_four_nodes_share_rollouts_and_a_poisoner_changes_nothing(tmp_path: Path):
    run, rounds = "four", 1_000_000  # runs until the test ends it
    config = loop_config(tmp_path / "sapo.toml", CONFIG.format(run=run, rounds=rounds, d=64, layers=2, heads=4))
    small = loop_config(tmp_path / "small.toml", CONFIG.format(run=run, rounds=rounds, d=32, layers=1, heads=2))
    swarm = Swarm(tmp_path / "nodes", config=config)
    attacker = HostilePeer(tmp_path)
    try:
        nodes = await asyncio.to_thread(swarm.start_chain, 3, "n", None)
        await attacker.start(nodes[0], f"sapo/{run}", max_size=64 * 1024)
        await asyncio.to_thread(wait_for, lambda: sapo(nodes[0])["round"] >= 3, 120, "the run to pass round 3")
        # a peer with a smaller policy joins a run in progress
        late = await asyncio.to_thread(swarm.start, "small", bootstrap=[nodes[-1].tcp_addr], config=small)
        nodes.append(late)
        me = attacker.peer_id
        fp = sapo(nodes[0])["fingerprint"]
        tag = [fp["layout"], fp["config"]]  # the run's own tag: the junk below gets past the task check

        r = sapo(nodes[0])["round"]
        wrong = {"r": r, "items": [{"spec": ["arith", question_seed(run, 1, me, r), k], "comps": ["99"] * 8}
                                   for k in range(8)], "t": tag}
        forged = {"r": r, "items": [{"spec": ["arith", question_seed(run, 1, nodes[1].peer_id, r), 0],
                                     "comps": ["12", "13"]}], "t": tag}
        claimed = {"r": r + 1, "items": [{"spec": ["arith", question_seed(run, 1, me, r + 1), 0],
                                          "comps": ["12", "13"], "answer": "12", "rewards": [1.0, 1.0]}], "t": tag}
        # well-formed, all wrong: scored 0 by every receiver's verifier, never trained on
        await attacker.send(wrong, ROLLOUTS)
        # a round the run does not have (rounds run 0 .. rounds - 1). A round far ahead of ours but inside the run
        # is the sender's own business (rounds are each peer's own): its items are verified like any other
        future = {"r": rounds, "items": [{"spec": ["arith", question_seed(run, 1, me, rounds), 0],
                                          "comps": ["12", "13"]}], "t": tag}
        for junk in (b"\xc1\xc1", forged, claimed, future, {"r": r, "items": "x" * 40, "t": tag}):
            await attacker.send(junk, ROLLOUTS)
        ids = [n.peer_id for n in nodes]

        def everyone_learned_from_everyone():
            states = [sapo(n) for n in nodes]
            for s in states:  # every node trained on items of every other honest peer, the small policy's included
                used = {p for p, v in s["sources"].items() if p in ids and v["used"] > 0}
                if len(used) < 3 or states[3]["round"] < 20:
                    return None
            return states

        final = await asyncio.to_thread(wait_for, everyone_learned_from_everyone, 150,
                                        "every node to train on every other node's rollouts")
        for s in final:
            assert s["state"] == "running" and s["items_used_external"] > 0 and s["items_shared"] > 0
            assert s["dropped_zero_advantage"] > 0
            if me in s["sources"]:  # the poisoner's items: scored by our own verifier at 0, never used
                assert s["sources"][me]["reward"] == 0.0 and s["sources"][me]["used"] == 0
        assert me in final[0]["sources"]  # its direct neighbour received and scored the wrong answers
        assert final[0]["rejected_malformed"] >= 3 and final[0]["rejected_future"] >= 1
        assert nodes[0].status()["penalties"].get("invalid_message", 0) >= 4
        # the late peer ran its own rounds from 0 (rounds are each peer's own), and learned from everyone
        assert final[3]["policy_parameters"] < final[0]["policy_parameters"] and final[3]["joined_at"] == 0
        assert final[3]["fingerprint"] == final[0]["fingerprint"]  # another policy, the same run
        # per-round rewards and items are in the replicated state, for every peer, as any node sees it
        def progress():
            p = http_get(nodes[1].url + "/state")["objects"]["progress"]
            return set(p) >= set(ids) and all(p[i]["round"] > 0 and {"reward", "cumulative_reward", "items_shared",
                                                                      "items_used_external"} <= set(p[i]["metrics"])
                                               for i in ids)

        await asyncio.to_thread(wait_for, progress, 30, "every node's progress in the replicated state")
        history = await asyncio.to_thread(http_get, nodes[2].url + "/sapo/history")
        assert [h[0] for h in history["rounds"]][:10] == list(range(10))
    finally:
        await attacker.close()
        await asyncio.to_thread(swarm.close)


@pytest.mark.swarm
@pytest.mark.timeout(120)
async def test_a_fresh_keys_round_number_moves_no_ones_round(tmp_path: Path):
    # issue 14 item 6: one SAPO rollout message for round 299 made a waiting node jump to round 299 and finish
    run = "jump"
    config = loop_config(tmp_path / "sapo.toml", CONFIG.format(run=run, rounds=300, d=32, layers=1, heads=2))
    swarm = Swarm(tmp_path / "nodes", config=config)
    attacker = HostilePeer(tmp_path)
    try:
        node = await asyncio.to_thread(swarm.start, "lonely")  # min_peers = 3: it waits for two more
        await attacker.start(node, f"sapo/{run}", max_size=64 * 1024)
        await asyncio.to_thread(wait_for, lambda: sapo(node)["state"] == "waiting for peers", 30, "the policy")
        fp = sapo(node)["fingerprint"]
        me = attacker.peer_id
        items = {"r": 299, "items": [{"spec": ["arith", question_seed(run, 1, me, 299), k], "comps": ["1", "2"]}
                                     for k in range(2)], "t": [fp["layout"], fp["config"]]}
        await attacker.send(items, ROLLOUTS)
        await asyncio.to_thread(wait_for, lambda: sapo(node)["peers_with_items"] == 1, 20, "the items to be held")
        s = sapo(node)
        assert s["round"] == 0 and s["state"] == "waiting for peers" and s["joined_at"] == 0
    finally:
        await attacker.close()
        await asyncio.to_thread(swarm.close)
