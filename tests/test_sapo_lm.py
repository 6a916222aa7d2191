"""SAPO with a transformers causal LM as the policy (protocols.tasks.hf_policy): the GRPO loss, the policy's step,
LoRA, export, a verifiers-style environment (defined in this module, as its own ``load_environment()``), wire bounds,
bad input, and four node processes (one with a smaller model) on a reasoning-gym dataset, one killed and resumed."""

import asyncio
import json
from pathlib import Path

import pytest
import torch

from swarmd.protocols import checkpoint, grpo
from swarmd.protocols.grpo import Group
from swarmd.protocols.sapo import ROLLOUTS, Rules, SapoConfig, parse_items, question_seed, score
from swarmd.protocols.task import TaskError, load, seeded
from hostile import HostilePeer
from swarmproc import Swarm, loop_config, run_cli, wait_for

SUMS = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
TINY = {"datasets": SUMS, "max_new_tokens": 4, "vocab_size": 320,
        "config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "num_key_value_heads": 2}}


# ------------------------------------------------------------------ a verifiers single-turn environment
class Parser:
    def parse_answer(self, completion) -> str:
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        return text.strip()


class Rubric:
    def __init__(self, funcs, weights, parser):
        self.funcs, self.weights, self.parser = funcs, weights, parser


class SingleTurnEnv:
    message_type = "chat"

    def __init__(self, dataset, system_prompt, parser, rubric):
        self.dataset, self.system_prompt, self.parser, self.rubric = dataset, system_prompt, parser, rubric


def correct_answer(completion, answer, parser) -> float:
    return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0


async def brief(completion, **kwargs) -> float:  # verifiers' reward functions may be coroutines
    return 1.0 if len(completion[-1]["content"]) <= 3 else 0.0


def explode(completion) -> float:
    raise RuntimeError("the grader's API is down")


def load_environment(n: int = 40, broken: bool = False, real: bool = False) -> SingleTurnEnv:
    """This module's environment; ``real``: built with verifiers' own SingleTurnEnv and Rubric (0.3)."""
    rows = [{"question": f"What is {a} plus {b}?", "answer": str(a + b), "info": {"a": a}}
            for a in range(n // 8 + 1) for b in range(8)][:n]
    funcs, weights = [correct_answer, brief], [0.75, 0.25]
    if broken:
        funcs, weights = funcs + [explode], weights + [1.0]
    if real:
        import verifiers as vf
        from datasets import Dataset

        return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), system_prompt="Reply with a number.",
                                parser=vf.Parser(), rubric=vf.Rubric(funcs=funcs, weights=weights, parser=vf.Parser()))
    return SingleTurnEnv(rows, "Reply with a number.", Parser(), Rubric(funcs, weights, Parser()))


# ------------------------------------------------------------------ the GRPO loss and the policy
@pytest.mark.beside
def test_grpo_loss_clips_and_adds_the_kl_to_the_reference():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = torch.tensor([[2.0]])
    value = grpo.loss(logp, logp.detach(), adv, mask)
    assert value.item() == pytest.approx(-2.0)  # ratio 1: minus the advantage, over completion tokens only
    value.backward()
    assert logp.grad[0, 2] == 0 and logp.grad[0, 0] < 0  # a positive advantage pushes the log-prob up
    far = grpo.loss(logp.detach() + 1.0, logp.detach(), adv, mask)  # ratio e > 1 + eps_high: clipped
    assert far.item() == pytest.approx(-2.0 * 1.28)
    same = grpo.loss(logp.detach(), logp.detach(), adv, mask, ref=logp.detach(), beta=0.5)
    assert same.item() == pytest.approx(-2.0)  # no KL where the policy is the reference
    apart = grpo.loss(logp.detach(), logp.detach(), adv, mask, ref=logp.detach() - 1.0, beta=0.5)
    assert apart.item() == pytest.approx(-2.0 + 0.5 * (torch.exp(torch.tensor(-1.0)).item() + 1.0 - 1.0))
    assert grpo.advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx([1.0, -1.0, -1.0, 1.0])


def completion_logprob(policy, prompt: str, text: str) -> float:
    with torch.no_grad():
        ids, _ = policy._completion_ids(text)
        batch = policy._batch([(policy._prompt_ids(prompt), ids)])
        return float((policy._logprobs(policy.model, batch[0], batch[1]) * batch[2]).sum())


@pytest.mark.beside
@pytest.mark.timeout(120)
def test_a_transformers_policy_samples_and_its_grpo_step_raises_rewarded_completions():
    torch.set_num_threads(1)
    task = load("hf-lm", {**TINY, "lr": 3e-3, "beta": 0.02}, "sapo")
    with seeded(5):
        policy = task.obj.policy(5)
    q = task.obj.question("chain_sum", 11, 0)
    assert q.prompt.endswith("=") or "=" in q.prompt
    out = policy.generate([q.prompt, "1 + 2 ="], 6)
    assert len(out) == 2 and all(len(c) == 6 and all(isinstance(x, str) for x in c) for c in out)
    longest = max(len(policy.tok.decode([i])) for i in range(len(policy.tok)))
    assert all(len(x) <= 4 * longest for c in out for x in c)  # max_new_tokens = 4
    answer = task.obj.env.reference(q)
    group = score(task, "chain_sum", 11, 0, [answer, "x", "y y", "zz"])
    assert group.rewards[0] == 1.0 and group.rewards[1:] == [0.0, 0.0, 0.0]
    before = completion_logprob(policy, q.prompt, answer)
    weights = [p.detach().clone() for p in policy.model.parameters()]
    assert policy.step([Group(q.prompt, ["x", "y"], [0.0, 0.0])])["groups"] == 0  # no advantage: no step
    assert all(torch.equal(a, b) for a, b in zip(weights, policy.model.parameters()))
    for _ in range(8):
        result = policy.step([group])
    assert result["groups"] == 1 and result["truncated"] == 0
    assert completion_logprob(policy, q.prompt, answer) > before + 1.0
    long = policy.step([Group(q.prompt, ["1 2 3 4 5 6 7 8 9", "x"], [1.0, 0.0])])
    assert long["truncated"] == 1  # cut to our own token budget (max_new_tokens), counted


@pytest.mark.beside
@pytest.mark.timeout(120)
def test_lora_trains_adapters_only_and_exports_merged_or_kept(tmp_path):
    PeftModel = pytest.importorskip("peft", reason="the lm extra (peft) is not installed").PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    for merged in (True, False):
        task = load("hf-lm", {**TINY, "lora_r": 4, "beta": 0.1, "lr": 1e-2, "export_merged": merged}, "sapo")
        with seeded(2):
            policy = task.obj.policy(2)
        base = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" not in n}
        trained = [n for n, p in policy.model.named_parameters() if p.requires_grad]
        assert trained and all("lora_" in n for n in trained)
        q = task.obj.question("chain_sum", 3, 1)
        for _ in range(3):
            assert policy.step([Group(q.prompt, ["4", "x", "4", "y"], [1.0, 0.0, 1.0, 0.0])])["groups"] == 1
        assert all(torch.equal(base[n], p) for n, p in policy.model.named_parameters() if n in base)
        prompt = policy._prompt_ids(q.prompt)
        with torch.no_grad():
            expected = policy.model(input_ids=torch.tensor([prompt])).logits
        out = tmp_path / f"export-{merged}"
        task.obj.export_pretrained(policy.model, str(out))
        if merged:
            model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
            assert not (out / "adapter_config.json").exists()
        else:
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"), out)
        tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
        text = tok.apply_chat_template([{"role": "system", "content": task.obj.system_prompt},
                                        {"role": "user", "content": q.prompt}], tokenize=False,
                                       add_generation_prompt=True)
        assert tok(text, add_special_tokens=False)["input_ids"] == prompt  # the same tokens, the same template
        with torch.no_grad():
            assert torch.allclose(model.eval()(input_ids=torch.tensor([prompt])).logits, expected, atol=1e-4)


def real_verifiers() -> bool:
    try:
        import verifiers
    except ImportError:
        return False
    return hasattr(verifiers, "SingleTurnEnv")


@pytest.mark.beside
@pytest.mark.timeout(120)
@pytest.mark.parametrize("real", [False, pytest.param(True, marks=pytest.mark.skipif(
    not real_verifiers(), reason="the verifiers extra (0.3) is not installed"))])
def test_a_verifiers_environment_is_looked_up_and_scored_by_its_own_rubric(real):
    task = load("hf-lm", {**TINY, "env": "verifiers:test_sapo_lm", "env_args": {"n": 40, "real": real}}, "sapo")
    assert task.obj.datasets == ["test_sapo_lm"] and task.obj.system_prompt == "Reply with a number."
    q_seed = question_seed("r", 1, "12D3KooWAuthor", 4)
    prompts = set()
    for k in range(8):
        q, again = task.obj.question("test_sapo_lm", q_seed, k), task.obj.question("test_sapo_lm", q_seed, k)
        assert q.prompt == again.prompt and q.prompt.startswith("What is ")
        prompts.add(q.prompt)
        right = q.row["answer"]
        group = score(task, "test_sapo_lm", q_seed, k, [right, "  " + right + "  ", "1234", "x" * 9 if right != "x"
                                                        else "y"])
        # the rubric's weighted sum over the sum of its weights: correct 0.75, brief (<= 3 characters) 0.25
        assert group.rewards[:2] == [1.0, 0.75] and group.rewards[2] == 0.0
    assert len(prompts) > 4
    other = load("hf-lm", {**TINY, "env": "verifiers:test_sapo_lm", "env_args": {"n": 24, "real": real}}, "sapo")
    assert other.obj.environment != task.obj.environment  # another dataset: another run's fingerprint
    with seeded(1):
        policy = task.obj.policy(1)
    assert len(policy.generate([q.prompt], 3)[0]) == 3


@pytest.mark.beside
@pytest.mark.timeout(120)
def test_bad_model_directories_and_raising_rubrics_give_one_line_errors(tmp_path):
    def error(options) -> str:
        with pytest.raises(TaskError) as e:
            load("hf-lm", options, "sapo")
        assert "\n" not in str(e.value) and "Traceback" not in str(e.value)
        return str(e.value)

    assert f"model directory {tmp_path}/nope does not exist" in error({"pretrained": str(tmp_path / "nope")})
    message = error({**TINY, "env": "verifiers:test_sapo_lm", "env_args": {"broken": True}})
    assert "RuntimeError: the grader's API is down" in message
    assert "cannot be imported" in error({"env": "verifiers:no_such_env_module"})
    assert "has no load_environment()" in error({"env": "verifiers:json"})
    assert "env must be" in error({"env": "gsm8k"})
    path = loop_config(tmp_path / "bad.toml", f'[loops.sapo]\ntask = "hf-lm"\n[loops.sapo.task_options]\n'
                       f'pretrained = "{tmp_path}/nope"\n')
    result = run_cli("start", "--config", str(path), "--data-dir", str(tmp_path / "d"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "does not exist" in result.stderr


@pytest.mark.beside
@pytest.mark.timeout(120)
def test_text_completions_are_bounded_and_validated_on_the_wire():
    task = load("hf-lm", {**TINY, "max_completion": 12}, "sapo")
    rules = Rules(task, SapoConfig(questions=4, completions=4))
    seed = question_seed("r", 1, "A", 0)

    def body(*comps):
        return {"r": 0, "items": [{"spec": ["chain_sum", seed, 0], "comps": list(comps)}]}

    assert parse_items(body("12", "tr\u00e8s bien\n"), run="r", seed=1, author="A", rules=rules)[1][0][2][1] == \
        "tr\u00e8s bien\n"  # any printable text, newlines included: a language model's answer
    for comps in (("12", "x" * 13), ("12", "a\x00b"), ("12", "\x1b[2J"), ("12", b"12")):
        with pytest.raises(ValueError):
            parse_items(body(*comps), run="r", seed=1, author="A", rules=rules)


# ------------------------------------------------------------------ four node processes
CONFIG = """
[loops.sapo]
run = "lm"
task = "hf-lm"
rounds = {rounds}
questions = 2
completions = 4
local = 1
external = 2
max_per_source = 1
min_peers = 4
deadline = 8.0
checkpoint_every = 3
report_every = 3
device = "cpu"

[loops.sapo.task_options]
max_new_tokens = 4
vocab_size = 320
sft_steps = 40
sft_lr = 3e-3
lr = 1e-3
config = {config}

[loops.sapo.task_options.datasets.chain_sum]
min_terms = 2
max_terms = 2
min_digits = 1
max_digits = 1
"""
SMALL = '{hidden_size = 32, intermediate_size = 64, num_hidden_layers = 1, num_attention_heads = 2, ' \
        'num_key_value_heads = 2}'
LARGER = '{hidden_size = 64, intermediate_size = 128, num_hidden_layers = 2, num_attention_heads = 4, ' \
         'num_key_value_heads = 4}'


def sapo(node) -> dict:
    return node.status()["services"]["sapo"]


def start_four(swarm: Swarm, larger: Path) -> list:
    """Three peers with the small model and one with the larger, started together; each loads transformers,
    reasoning-gym and trains its tokenizer before it listens, which on a busy 2-core box takes longer than
    start_chain's wait."""
    listen, bootstrap = swarm._prepared_first("n0")
    nodes = [swarm.start("n0", *listen, wait=False)]
    nodes += [swarm.start(f"n{i}", bootstrap=[bootstrap], wait=False) for i in (1, 2)]
    nodes.append(swarm.start("big", bootstrap=[bootstrap], wait=False, config=larger))
    for node in nodes:
        node.wait_ready(180)
    return nodes


@pytest.mark.swarm
@pytest.mark.timeout(600)
async def test_four_lm_peers_share_rollouts_survive_kill_9_and_export(tmp_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rounds = 40  # long enough that the others still run when the killed peer is back (it needs 3 peers to start)
    config = loop_config(tmp_path / "lm.toml", CONFIG.format(rounds=rounds, config=SMALL))
    larger = loop_config(tmp_path / "larger.toml", CONFIG.format(rounds=rounds, config=LARGER))
    swarm = Swarm(tmp_path / "nodes", config=config)
    attacker = HostilePeer(tmp_path)
    try:
        nodes = await asyncio.to_thread(start_four, swarm, larger)
        await attacker.start(nodes[0], "sapo/lm", max_size=64 * 1024)
        await asyncio.to_thread(wait_for, lambda: (sapo(nodes[1])["checkpoint"] or {}).get("round", 0) >= 3, 240,
                                "node 1's checkpoint at round 3")
        # a flood: more rounds of items than anyone computes in a second, signed by one peer
        fp = sapo(nodes[0])["fingerprint"]
        me = attacker.peer_id
        for r in range(12):
            await attacker.send({"r": r, "items": [{"spec": ["chain_sum", question_seed("lm", 1, me, r), 0],
                                                    "comps": ["1", "2"]}], "t": [fp["layout"], fp["config"]]},
                                ROLLOUTS)
        nodes[1].kill()  # kill -9: no shutdown, no final save
        saved = checkpoint.read_meta(checkpoint.latest(nodes[1].data_dir, "sapo"))
        nodes[1] = await asyncio.to_thread(swarm.start, "n1", bootstrap=[nodes[0].tcp_addr], wait=False)
        await asyncio.to_thread(nodes[1].wait_ready, 180)
        resumed = await asyncio.to_thread(wait_for, lambda: sapo(nodes[1])["resumed"], 120, "n1 to resume")
        assert resumed["source"] == "own checkpoint" and resumed["round"] == saved["round"] >= 3
        assert resumed["optimizer_state"] is True
        final = await asyncio.to_thread(wait_for, lambda: all(sapo(n)["state"] == "done" for n in nodes) and [
            sapo(n) for n in nodes], 300, "every peer to finish")
        ids = {n.peer_id for n in nodes}
        for s in final:
            assert s["round"] == rounds and s["error"] is None and s["items_shared"] > 0
            assert s["completions_received"] > 0 and s["completion_bytes_received"] >= s["completions_received"]
        assert sum(s["items_used_external"] for s in final) > 0
        assert final[3]["policy_parameters"] > final[0]["policy_parameters"]  # another model, the same run
        assert final[3]["fingerprint"] == final[0]["fingerprint"]
        used_from = {p for s in final for p, v in s["sources"].items() if v["used"] > 0}
        assert len(used_from & ids) >= 3  # honest peers learned from each other (the flood is well-formed too)
        assert final[0]["ignored_rate"] > 0 and nodes[0].status()["penalties"].get("rate_limited", 0) > 0
        # the exported policy is a save_pretrained directory with its tokenizer and chat template
        out = tmp_path / "exported"
        result = await asyncio.to_thread(run_cli, "export", "--data-dir", str(nodes[3].data_dir), "--loop", "sapo",
                                         "--out", str(tmp_path / "w.safetensors"), "--pretrained", str(out),
                                         "--config", str(larger))  # the config that node ran with
        assert result.returncode == 0, result.stderr
        model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
        tensors, _ = checkpoint.load(checkpoint.latest(nodes[3].data_dir, "sapo"))
        state = checkpoint.model_state(tensors)
        assert all(torch.equal(state[n], p) for n, p in model.state_dict().items() if n in state)
        assert json.loads((out / "config.json").read_text())["hidden_size"] == 64
        ids_in = tok.apply_chat_template([{"role": "user", "content": "3 + 4 ="}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]
        assert model.generate(ids_in, max_new_tokens=3, do_sample=False).shape[1] <= ids_in.shape[1] + 3
    finally:
        await attacker.close()
        await asyncio.to_thread(swarm.close)


@pytest.mark.beside
@pytest.mark.timeout(120)
def test_the_example_config_names_options_the_task_takes():
    import tomllib

    from swarmproc import REPO

    table = tomllib.loads((REPO / "configs" / "sapo-lm.toml").read_text())["loops"]["sapo"]
    assert load(table["task"], table["task_options"], "sapo").obj.datasets == ["chain_sum"]
