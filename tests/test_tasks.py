"""The task seam: a user's own task file for every loop, the built-in tasks through it, clear errors for bad tasks,
weights that outlive the node (checkpoint, kill -9, resume; export), and peers that train something else refused."""

import contextlib
import re
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from swarmd.protocols import checkpoint, codecs, exchange, tinylm
from swarmd.protocols.inner import lr_scale
from swarmd.protocols.task import TaskError, balanced_fragments, build_model, fragment_indices, load, trainable
from swarmproc import REPO, Swarm, loop_config, run_cli, wait_for

EXAMPLE = REPO / "examples" / "my_task.py"

TINY = """
import torch
import torch.nn.functional as F


class Task:
    def __init__(self, hidden, nan_after):
        self.hidden, self.nan_after = hidden, nan_after
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(512, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g)

    def model(self):
        return torch.nn.Sequential(torch.nn.Linear(8, self.hidden), torch.nn.Tanh(), torch.nn.Linear(self.hidden, 1))

    def data(self, shard, seed):
        g = torch.Generator().manual_seed(seed * 1000 + shard)
        step = 0
        while True:
            idx = torch.randint(0, 512, (32,), generator=g)
            yield self.x[idx], self.y[idx], step
            step += 1

    def loss(self, model, batch):
        x, y, step = batch
        loss = F.mse_loss(model(x), y)
        return loss * float("nan") if 0 <= self.nan_after <= step < self.nan_after + 3 else loss

    def evaluate(self, model):
        return float(F.mse_loss(model(self.x), self.y))
{extra}

def make_task(hidden=16, nan_after=-1):
    return Task(hidden, nan_after)
"""


def write_task(folder: Path, name: str = "tiny_task.py", extra: str = "", body: str | None = None) -> Path:
    path = folder / name
    path.write_text(body if body is not None else TINY.format(extra=textwrap.indent(textwrap.dedent(extra), "    ")))
    return path


# ------------------------------------------------------------------ the seam itself (in process)
@pytest.mark.beside
def test_the_guide_shows_the_example_task_file_as_it_is():
    # the docs build includes the file itself (a snippet), so the page cannot drift from it; tests/test_docs_blocks.py
    # runs the block
    guide = (REPO / "docs" / "guides" / "train-your-own-model.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    assert f'--8<-- "{EXAMPLE.relative_to(REPO)}"\n' in blocks, \
        "docs/guides/train-your-own-model.md must show examples/my_task.py as it is"


@pytest.mark.beside
def test_bad_task_files_give_one_line_errors_naming_the_file(tmp_path):
    def error(spec, options=None, kind="diloco"):
        with pytest.raises(TaskError) as e:
            load(spec, options or {}, kind)
        message = str(e.value)
        assert "\n" not in message and "Traceback" not in message
        return message

    assert "does not exist" in error(str(tmp_path / "missing.py") + ":make_task")
    broken = write_task(tmp_path, "broken.py", body="import nope_not_a_module\n")
    assert "broken.py raised ModuleNotFoundError on import" in error(f"{broken}:make_task")
    assert "has no function make_it()" in error(f"{write_task(tmp_path)}:make_it")
    assert "does not take these task_options" in error(f"{write_task(tmp_path)}:make_task", {"hiden": 3})
    raising = write_task(tmp_path, "raising.py", body="def make_task(n=1):\n    raise ValueError('n must be 2')\n")
    assert "rejected its task_options: ValueError: n must be 2" in error(f"{raising}:make_task")
    lacking = write_task(tmp_path, "lacking.py", body="class T:\n    def model(self): pass\n\n"
                                                       "def make_task():\n    return T()\n")
    assert "lacks data(), loss(), needed by the diloco loop" in error(f"{lacking}:make_task")
    assert "lacks datasets, question(), score(), policy()" in error(f"{lacking}:make_task", kind="sapo")
    assert "lacks loss(), needed by the spsa loop" in error(f"{lacking}:make_task", kind="spsa")
    no_batches = write_task(tmp_path, "no_batches.py", body="class T:\n    def model(self): pass\n\n"
                                                           "    def loss(self, model, batch): pass\n\n"
                                                           "def make_task():\n    return T()\n")
    assert "lacks data() or batch_at(), needed by the spsa loop" in error(f"{no_batches}:make_task", kind="spsa")
    by_step = write_task(tmp_path, "by_step.py", body="class T:\n    def model(self): pass\n\n"
                                                     "    def loss(self, model, batch): pass\n\n"
                                                     "    def batch_at(self, shard, seed, step): pass\n\n"
                                                     "def make_task():\n    return T()\n")
    assert load(f"{by_step}:make_task", {}, "spsa").has("batch_at")  # batches by step alone are enough for SPSA
    assert "expected 'path/to/file.py:factory'" in error("no-such-builtin")
    wrong_file = write_task(tmp_path, "wrong.py", extra="def model(self):\n    return 3\n")
    wrong = load(f"{wrong_file}:make_task", {}, "diloco")
    with pytest.raises(TaskError, match=r"wrong.py:make_task: model\(\) returned int, expected a torch.nn.Module"):
        build_model(wrong, 1)


@pytest.mark.beside
@pytest.mark.parametrize("name,options", [("tinygpt", {"domain": "target"}), ("digits", {}), ("regression", {})])
def test_builtin_batches_by_step_are_a_function_of_shard_seed_and_step(name, options):
    """What lets an SPSA peer re-probe another's step: anyone draws the same batch from (shard, seed, step)."""
    task = load(name, options, "spsa")

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b)) if isinstance(a, tuple) else torch.equal(a, b)

    first = task.call("batch_at", 12345, 1, 7)
    assert same(first, load(name, options, "spsa").call("batch_at", 12345, 1, 7))  # another peer's copy
    assert not same(first, task.call("batch_at", 12345, 1, 8)) and not same(first, task.call("batch_at", 999, 1, 7))
    if name == "tinygpt":  # its stream is its batches by step, in order
        stream = task.call("data", 12345, 1)
        assert same([next(stream) for _ in range(8)][7], first)


@pytest.mark.beside
def test_default_fragments_work_for_any_model_and_the_same_seed_builds_the_same_weights(tmp_path):
    task = load(f"{write_task(tmp_path)}:make_task", {"hidden": 64}, "diloco")
    model = build_model(task, 7)
    named = trainable(model)
    groups = balanced_fragments(named, 3)
    assert sorted(n for g in groups for n in g) == sorted(n for n, _ in named) and all(groups)
    assert [len(g) for g in fragment_indices(task, model, 2)] == [1, 3]  # 512 weights | 64 + 64 + 1
    again = build_model(task, 7)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    state = torch.random.get_rng_state()
    build_model(task, 8)
    assert torch.equal(state, torch.random.get_rng_state())  # our seeding does not leak into the process


# not `beside`: each CLI run imports torch (~3.5 s of CPU), which the niced worker may wait on for longer than a run's
# time limit while the real-time tests fill both cores
def test_cli_refuses_a_bad_task_before_starting(tmp_path):
    path = loop_config(tmp_path / "c.toml", f'[loops.diloco]\ntask = "{tmp_path}/missing.py:make_task"\n')
    result = run_cli("start", "--config", str(path), "--data-dir", str(tmp_path / "d"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"swarmd: error: loops.diloco.task: task file {tmp_path}/missing.py does not exist"
    path.write_text(path.read_text().replace("missing.py", "tiny_task.py") + "[loops.diloco.task_options]\nx = 1\n")
    write_task(tmp_path)
    result = run_cli("start", "--config", str(path), "--data-dir", str(tmp_path / "d"))
    assert result.returncode == 2 and "does not take these task_options" in result.stderr


# ------------------------------------------------------------------ real processes
DILOCO = """
[loops.diloco]
run = "{run}"
task = "{task}"
rounds = {rounds}
inner_steps = {h}
min_peers = {min_peers}
deadline_low = {deadline_low}
checkpoint_every = 1
device = "cpu"
{extra}

[loops.diloco.task_options]
{options}
"""


def diloco(node) -> dict:
    return node.status()["services"]["diloco"]


def config(tmp_path: Path, name: str = "c", *, run="t", task="tinygpt", rounds=3, h=10, min_peers=2, options="",
           deadline_low=2.0, extra=""):
    return loop_config(tmp_path / f"{name}.toml", DILOCO.format(run=run, task=task, rounds=rounds, h=h,
                                                                min_peers=min_peers, options=options,
                                                                deadline_low=deadline_low, extra=extra))


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_the_example_task_file_trains_across_two_nodes_and_exports(tmp_path):
    task_file = tmp_path / "elsewhere" / "my_task.py"  # a user's file, outside the repository
    task_file.parent.mkdir()
    task_file.write_text(EXAMPLE.read_text())
    swarm = Swarm(tmp_path / "nodes", config=config(tmp_path, task=f"{task_file}:make_task", rounds=3, h=15))
    try:
        nodes = swarm.start_chain(2, members_within=None)
        final = wait_for(lambda: all(diloco(n)["state"] == "done" for n in nodes) and [diloco(n) for n in nodes],
                         180, "2 nodes to finish 3 rounds of the example task")
        assert final[0]["final_hash"] == final[1]["final_hash"]
        assert all(h["participants"] == 2 for h in final[0]["history"])
        losses = [loss for _, loss in final[0]["losses"]]
        assert len(losses) == 3 and losses[-1] < losses[0]
        assert final[0]["checkpoint"]["round"] == 3 and final[0]["checkpoint"]["hash"] == final[0]["final_hash"]
        assert final[0]["threads"] == 1  # threads = 0 (auto) follows OMP_NUM_THREADS=1, which the harness sets
        # the human summary names the loop's state, round, loss and bytes
        summary = run_cli("status", "--http", nodes[0].url).stdout
        assert re.search(r"diloco +done +round 3/3 +step \d+ +loss [\d.]+ +sent [\d.]+ MB, received [\d.]+ MB",
                         summary), summary
        # the exported weights load into a fresh model of the task and evaluate as the run ended
        out = tmp_path / "final.safetensors"
        result = run_cli("export", "--data-dir", str(nodes[0].data_dir), "--out", str(out))
        assert result.returncode == 0, result.stderr
        task = load(f"{task_file}:make_task", {}, "diloco")
        fresh = build_model(task, 999)
        fresh.load_state_dict(load_file(str(out)))
        assert abs(task.obj.evaluate(fresh) - losses[-1]) < 1e-4
    finally:
        swarm.close()


@pytest.mark.beside
def test_threads_default_to_omp_num_threads_else_all_cores_but_one(monkeypatch):
    from swarmd.protocols.task import auto_threads, set_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert auto_threads() == 3 and set_threads(0) == 3 and torch.get_num_threads() == 3
        assert set_threads(2) == 2 and torch.get_num_threads() == 2  # an explicit count wins
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
        assert auto_threads() == 7  # one core left to the node's own work
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
        assert auto_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "junk")  # not a count: ignored
        assert auto_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(Exception):
        from swarmd.protocols.diloco import DilocoConfig

        DilocoConfig(threads=-1)


@pytest.mark.beside
def test_inner_betas_are_two_numbers_in_0_1():
    from swarmd.protocols.diloco import DilocoConfig

    for betas in ([0.9, 1.0], [0.9], [-0.1, 0.95], "0.9", [0.9, 0.95, 0.99]):
        with pytest.raises(Exception, match="inner_betas"):
            DilocoConfig(inner_betas=betas)
    assert DilocoConfig(inner_betas=[0.9, 0.99]).inner_betas == (0.9, 0.99)
    assert DilocoConfig().inner_betas == (0.9, 0.95)


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_checkpoint_kill_9_and_restart_resumes_at_the_saved_round(tmp_path):
    # with a learning-rate schedule: it goes by the run's step, so the restarted node carries on with it; and 1-bit
    # updates, whose error feedback residual is ours to keep too
    schedule = ('lr_schedule = "cosine"\nwarmup_steps = 5\nlr_final = 0.2\ninner_lr = 1e-3\ncodec = "sign"\n'
                'inner_betas = [0.9, 0.99]')
    swarm = Swarm(tmp_path / "nodes", config=config(tmp_path, rounds=6, h=10, min_peers=1, options="batch = 8",
                                                    extra=schedule))
    try:
        node = swarm.start("solo")
        wait_for(lambda: (diloco(node)["checkpoint"] or {}).get("round", 0) >= 2, 120, "a checkpoint at round 2")
        node.kill()  # kill -9: no shutdown, no final save
        path = checkpoint.latest(node.data_dir, "diloco")
        meta = checkpoint.read_meta(path)
        assert meta["fingerprint"] and meta["round"] >= 2
        saved, _ = checkpoint.load(path)
        assert float(saved["feedback.0"].norm()) > 0  # what the sign code dropped of the last update
        node = swarm.start("solo")
        resumed = wait_for(lambda: diloco(node)["resumed"], 60, "the restarted node to resume")
        assert resumed == {"source": "own checkpoint", "round": meta["round"], "step": meta["step"],
                           "hash": meta["hash"], "optimizer_state": True,  # AdamW's moments came back too
                           "residual": [0]}  # and the residual of fragment 0
        assert meta["optimizer"]["class"] == "SwarmAdamW"  # the default inner optimizer
        final = wait_for(lambda: diloco(node)["state"] == "done" and diloco(node), 120, "the run to finish")
        assert [h["round"] for h in final["history"]] == list(range(meta["round"], 6))
        assert final["checkpoint"]["round"] == 6
        # the last of the 60 steps (index 59) took the cosine's end: 1e-3 x lr_scale(59, 60, 5, 0.2), not 1e-3
        assert final["inner_lr"] == [round(1e-3 * lr_scale(59, 60, 5, 0.2), 8)]
        assert final["inner_lr"][0] < 0.21e-3
        assert final["inner_betas"] == [[0.9, 0.99]]  # the config's, into the optimizer and through the restart
    finally:
        swarm.close()


@pytest.mark.swarm
@pytest.mark.timeout(240)
@pytest.mark.parametrize("version", ["before the e3m0 encoder", "before the BLAKE3 weights hash",
                                     "before the exact screen", "with other rules"])
def test_a_checkpoint_saved_by_a_version_before_is_resumed(tmp_path, version):
    """The weights' hash became BLAKE3 and the run's fingerprint names it (outer.WEIGHTS_HASH); later the fingerprint
    named how e3m0 picks its codes (codecs.E3M0_ENCODER; this run's codec, and so its reduced codec, is e3m0); later
    the reduction rule's text changed and the outer step was named (outer.OUTER_STEP); and a version whose rules
    we do not list resumes a checkpoint that names the run as ours does (its "resumable" fingerprint). A node
    upgraded in the middle of a run still resumes from the checkpoint a version before saved (its fingerprint without
    the names it lacked; before BLAKE3, its hash BLAKE2b), not from round 0."""
    import tomllib

    from swarmd.protocols import outer
    from swarmd.protocols import task as tasks
    from swarmd.protocols.diloco import DilocoConfig

    rounds = 12  # room to be killed mid-run: a solo round takes a fraction of a second, and a run that ended before
    # the kill resumes done, saves nothing again, and leaves the version before's checkpoint (4 can be too few in CI)
    text = DILOCO.format(run="up", task="tinygpt", rounds=rounds, h=5, min_peers=1, options="", deadline_low=2.0,
                         extra="")
    swarm = Swarm(tmp_path / "nodes", config=loop_config(tmp_path / "up.toml", text))
    try:
        node = swarm.start("solo")
        wait_for(lambda: (diloco(node)["checkpoint"] or {}).get("round", 0) >= 2, 120, "a checkpoint at round 2")
        node.kill()
        path = checkpoint.latest(node.data_dir, "diloco")
        tensors, meta = checkpoint.load(path)
        assert meta["round"] < rounds, meta["round"]
        # what the version before wrote for the same run and weights
        cfg = DilocoConfig(**tomllib.loads(text)["loops"]["diloco"])
        task = tasks.load(cfg.task, cfg.options(), tasks.DILOCO)
        named = tasks.trainable(tasks.build_model(task, cfg.seed))
        shared = cfg.shared()
        assert meta["fingerprint"] == tasks.fingerprint(task, shared, named)
        weights = [outer.flatten([tensors["model." + name] for name, _ in named])]
        assert meta["hash"] == outer.params_hash(weights)
        assert shared["e3m0_encoder"] == codecs.E3M0_ENCODER
        blake2 = version == "before the BLAKE3 weights hash"
        lacked = {"e3m0_encoder", "weights_hash"} if blake2 else {"e3m0_encoder"}
        older = {k: v for k, v in shared.items() if k not in lacked}
        if version == "before the exact screen":  # the rule's text before, and no outer step named
            older = {**{k: v for k, v in shared.items() if k != "outer_step"},
                     "reduce_rule": exchange.REDUCE_RULE_BEFORE_EXACT}
        if version == "with other rules":  # a version we do not list, which names the run as we do
            assert meta["resumable"] == tasks.fingerprint(
                task, {k: v for k, v in shared.items() if k not in ("reduce_rule", "outer_step", "e3m0_encoder",
                                                                     "weights_hash")}, named)
            older = {**shared, "reduce_rule": "another rule", "outer_step": "another step"}
        kept = {k: v for k, v in meta.items() if k != "resumable" or version == "with other rules"}  # (not before)
        before = {**kept, "fingerprint": tasks.fingerprint(task, older, named),
                  "hash": outer.params_hash_before_blake3(weights) if blake2 else meta["hash"]}
        assert before["fingerprint"] != meta["fingerprint"]
        checkpoint.save(path, tensors, before)
        node = swarm.start("solo")
        resumed = wait_for(lambda: diloco(node)["resumed"], 60, "the restarted node to resume")
        assert resumed["source"] == "own checkpoint" and resumed["round"] == meta["round"], resumed
        assert resumed["hash"] == meta["hash"]  # the same weights, by our hash
        assert resumed.get("saved_by") == ("the version before the BLAKE3 weights hash" if blake2 else
                                           "a version with other rules (the same run)"
                                           if version == "with other rules" else None)
        final = wait_for(lambda: diloco(node)["state"] == "done" and diloco(node), 120, "the run to finish")
        assert [h["round"] for h in final["history"]] == list(range(meta["round"], rounds))
        assert checkpoint.read_meta(path)["fingerprint"] == meta["fingerprint"]  # saved again as this version
    finally:
        swarm.close()


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_a_peer_with_another_model_is_refused_and_the_others_rounds_are_unaffected(tmp_path):
    task = write_task(tmp_path)
    # an open-ended run (rounds = 0): it trains until the test stops it. Rounds take milliseconds of compute, so the
    # deadline floor must absorb the CPU stall of a third process starting on 2 cores (rounds still close as soon
    # as both updates are in): a missed deadline here would be the machine's, not the odd peer's
    swarm = Swarm(tmp_path / "nodes", config=config(tmp_path, task=f"{task}:make_task", rounds=0, h=20,
                                                    options="hidden = 16", deadline_low=15.0))
    other = config(tmp_path, "other", task=f"{task}:make_task", rounds=0, h=20, options="hidden = 32")
    try:
        nodes = swarm.start_chain(2, members_within=None)
        wait_for(lambda: diloco(nodes[0]).get("rounds", 0) >= 1, 120, "the run to close a round")
        odd = swarm.start("odd", bootstrap=[nodes[1].tcp_addr], config=other)
        refused = wait_for(lambda: diloco(odd)["state"] == "refused" and diloco(odd), 60, "the odd node to refuse")
        assert "peers with another task were seen in run 't'" in refused["refused"]
        assert "model parameter layout" in refused["refused"]
        doctor = run_cli("doctor", "--http", odd.url).stdout
        assert "diloco refused" in doctor and "model parameter layout" in doctor
        start = diloco(nodes[0])["rounds"]
        wait_for(lambda: diloco(nodes[0])["rounds"] >= start + 3, 120, "3 more rounds")
        for n in nodes:
            s = diloco(n)
            assert s["state"] == "running" and s["total_rounds"] == 0
            assert all(h["participants"] == 2 for h in s["history"]) and s.get("deadline_missed", 0) == 0
        # the nodes it linked to saw its messages and ignored them (ignored messages are not forwarded)
        wait_for(lambda: sum(diloco(n).get("rejected_task_mismatch", 0) for n in nodes) >= 1, 60,
                 "the odd node's messages to reach a linked node and be ignored")
        assert diloco(odd)["step"] == 0
        summary = run_cli("status", "--http", nodes[0].url).stdout
        assert re.search(r"diloco +running +round [1-9]\d*/open-ended", summary)
    finally:
        swarm.close()


@pytest.mark.swarm
@pytest.mark.timeout(180)
async def test_fresh_keys_claiming_another_task_do_not_refuse_a_node_that_waits_alone(tmp_path):
    # issue 80 item 6: keys that never connected, relayed with another run's tag, turned a node waiting for its
    # peers to "refused" with an ERROR blaming its own task; only a peer with standing or a direct link may
    import asyncio

    from hostile import HostilePeer

    from swarmd.protocols.diloco import READY
    from swarmd.transport.identity import Identity
    from swarmd.transport.wire import WIRE

    swarm = Swarm(tmp_path / "nodes", config=config(tmp_path, run="alone", rounds=2, h=10, min_peers=2))
    relay = HostilePeer(tmp_path / "relay")
    try:
        node = await asyncio.to_thread(swarm.start, "alone")
        await asyncio.to_thread(wait_for, lambda: diloco(node)["state"] == "waiting for peers", 60,
                                "the node to wait for its peers")
        await relay.start(node, "diloco/alone", max_size=1024)
        other = ["0" * 32, "1" * 32]  # another run's fingerprint
        for _ in range(20):
            await relay.send_as(Identity.generate(), WIRE.pack(READY, {"r": 0, "p": 0, "ready": "0" * 32,
                                                                       "t": other}))
        # what a refusal is made of is kept as each message is judged: none of them was kept
        s = await asyncio.to_thread(wait_for, lambda: diloco(node).get("rejected_task_mismatch", 0) >= 20
                                    and diloco(node), 60, "the fresh keys' messages to be seen and ignored")
        assert s["state"] == "waiting for peers" and not s.get("refused") and s["mismatched_peers"] == 0, s
        assert s["task_mismatch_unvouched"] == 20 and "another task" not in node.log()
        metrics = node.get("/metrics")
        assert 'swarmd_loop_task_mismatch_total{loop="diloco",run="alone"} 20.0' in metrics
        # a peer linked to us directly that trains something else (its "ready" repeated, as a peer's is): said, in
        # neutral words
        refused = None
        for _ in range(60):
            await relay.send(WIRE.pack(READY, {"r": 0, "p": 0, "ready": "0" * 32, "t": other}))
            s = await asyncio.to_thread(diloco, node)
            if s["state"] == "refused":
                refused = s
                break
            await asyncio.sleep(0.5)  # the pace of a peer's repeated "ready"
        assert refused is not None, "the node never said that peers with another task were seen"
        assert refused["refused"].startswith("peers with another task were seen in run 'alone'")
        assert refused["mismatched_peers"] == 1
    finally:
        await relay.close()
        await asyncio.to_thread(swarm.close)


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_a_task_that_breaks_at_run_time_fails_its_loop_clearly_and_nan_losses_are_skipped(tmp_path):
    wrong = write_task(tmp_path, "wrong.py", extra="def model(self):\n    return 'a model'\n")
    nan = write_task(tmp_path, "nan.py")
    swarm = Swarm(tmp_path / "nodes", config=config(tmp_path, task=f"{wrong}:make_task", min_peers=1))
    try:
        node = swarm.start("wrong")
        failed = wait_for(lambda: diloco(node)["state"] == "failed" and diloco(node), 60, "the loop to fail")
        assert failed["error"] == f"task {wrong}:make_task: model() returned str, expected a torch.nn.Module"
        assert node.get("/healthz")["ok"] is True  # the node keeps running
        assert node.log().count("model() returned str") == 1  # said once, not restarted in a loop
        bad = swarm.start("nan", config=config(tmp_path, "nan", task=f"{nan}:make_task", rounds=3, h=10,
                                               min_peers=1, options="nan_after = 12"))
        final = wait_for(lambda: diloco(bad)["state"] == "done" and diloco(bad), 120, "the NaN run to finish")
        assert final["nonfinite_loss"] == 3 and final["updates_withheld"] == 1
        assert "withholding our update" in bad.log() and "not sending our update for round 1/0" in bad.log()
        assert all(torch.isfinite(torch.tensor(loss)) for _, loss in final["losses"])
    finally:
        swarm.close()


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_a_transformers_model_on_real_text_trains_and_exports_a_pretrained_directory(tmp_path):
    # real text, a part of it: 40 modules of the standard library (~1 MB; all of it is ~5 MB, whose tokenizer each
    # of the 4 task loads here, 2 nodes, the export and the check below, took ~4 s to train and apply)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]:
        (corpus / path.name).write_bytes(path.read_bytes())
    options = (f'vocab_size = 512\nseq_len = 32\nbatch = 4\neval_batches = 2\ncorpus = "{corpus}"\n'
               '[loops.diloco.task_options.config]\nhidden_size = 32\nintermediate_size = 64\n'
               'num_hidden_layers = 2\nnum_attention_heads = 2\nnum_key_value_heads = 2\n')
    swarm = Swarm(tmp_path / "nodes", config=config(tmp_path, task="hf-text", rounds=2, h=8, options=options))
    try:
        nodes = swarm.start_chain(2, members_within=None)
        final = wait_for(lambda: all(diloco(n)["state"] == "done" for n in nodes) and [diloco(n) for n in nodes],
                         180, "2 nodes to train the transformers model")
        assert final[0]["final_hash"] == final[1]["final_hash"] and final[0]["device"] == "cpu"
        assert final[0]["losses"][-1][1] < 6.3  # below ln(512): it learned from the text
        out = tmp_path / "hf"
        result = run_cli("export", "--data-dir", str(nodes[1].data_dir), "--out", str(tmp_path / "w.safetensors"),
                         "--pretrained", str(out), "--config", str(swarm.config), timeout=120)
        assert result.returncode == 0, result.stderr
        from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

        model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(out)
        ids = tokenizer("def main():", return_tensors="pt").input_ids
        assert model(input_ids=ids).logits.shape[-1] == 512
        task = load("hf-text", {"vocab_size": 512, "seq_len": 32, "batch": 4, "eval_batches": 2,
                                "corpus": str(corpus), "config": {
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2}}, "diloco")
        assert abs(task.obj.evaluate(model) - final[1]["losses"][-1][1]) < 1e-3
    finally:
        swarm.close()


def _export_in(cwd: Path, *args: str):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "swarmd", "export", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=os.environ)


@pytest.mark.beside  # CLI runs with no deadline to meet
@pytest.mark.timeout(240)
def test_export_never_imports_the_task_a_weights_file_names_nor_writes_outside_with_its_run_name(tmp_path):
    # a shared weights file made to run a command on export, and to write outside the working directory
    marker = tmp_path / "ran"
    model = build_model(load("tinygpt", {}, "diloco"), 0)
    node_dir, cwd = tmp_path / "node", tmp_path / "work" / "here"
    cwd.mkdir(parents=True)
    checkpoint.save(node_dir / checkpoint.DIR / "diloco-x.safetensors",
                    {checkpoint.MODEL_PREFIX + k: v for k, v in model.state_dict().items()},
                    {"loop": "diloco", "run": "x/../../escaped", "round": 1, "task": "os:system",
                     "task_options": {"command": f"touch {marker}"}})
    # --pretrained without a task the user names is refused before anything is read
    result = _export_in(cwd, "--data-dir", str(node_dir), "--pretrained", str(cwd / "hf"))
    assert result.returncode == 2 and "--config" in result.stderr and "--task" in result.stderr, result.stderr
    assert not marker.exists()
    result = _export_in(cwd, "--data-dir", str(node_dir), "--pretrained", str(cwd / "hf"), "--config",
                        str(REPO / "configs" / "default.toml"))  # a config without a [loops.diloco] table
    assert result.returncode == 2 and "no [loops.diloco] table" in result.stderr, result.stderr
    # the user names the task: the model is rebuilt from it (the weights fit it), never from the file's os:system
    result = _export_in(cwd, "--data-dir", str(node_dir), "--pretrained", str(cwd / "hf"), "--task", "tinygpt")
    assert not marker.exists()
    assert result.returncode == 1 and "tinygpt" in result.stderr and "not a transformers model" in result.stderr, \
        result.stderr
    # the run name from the file became one harmless name part, in the working directory
    assert [p.name for p in cwd.iterdir()] == ["diloco-x_.._.._escaped-round1.safetensors"]
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["here"] and not list(tmp_path.glob("escaped*"))
    assert set(load_file(str(cwd / "diloco-x_.._.._escaped-round1.safetensors"))) == set(model.state_dict())


@contextlib.contextmanager
def spsa_and_sapo(tmp_path: Path, spsa_table: str, sapo_table: str):
    """Two SPSA nodes and two SAPO nodes in one swarm; yields the pairs."""
    spsa = loop_config(tmp_path / "spsa.toml", spsa_table)
    sapo = loop_config(tmp_path / "sapo.toml", sapo_table)
    swarm = Swarm(tmp_path / "nodes", config=spsa)
    try:
        a, b, c, d = swarm.start_chain(2, "spsa", None, more=[dict(name=n, config=sapo) for n in ("sapo0", "sapo1")])
        yield (a, b), (c, d)
    finally:
        swarm.close()


def finished(nodes, loop: str, what: str) -> list[dict]:
    def svc(n):
        return n.status()["services"][loop]

    return wait_for(lambda: all(svc(n)["state"] == "done" for n in nodes) and [svc(n) for n in nodes], 180, what)


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_spsa_on_the_digits_task_and_sapo_on_reasoning_gym(tmp_path):
    with spsa_and_sapo(tmp_path, '[loops.spsa]\nrun = "d"\ntask = "digits"\nsteps = 100\nwindow = 25\n'
                                 'min_peers = 2\nlr = 1e-2\neps = 1e-2\ncheckpoint_every = 2\n'
                                 '[loops.spsa.task_options]\nhidden = 32\n',
                       '[loops.sapo]\nrun = "g"\ntask = "reasoning-gym"\nrounds = 8\n'
                       'min_peers = 2\nquestions = 4\ncompletions = 4\nlocal = 2\n'
                       'external = 2\ncheckpoint_every = 4\n') as (spsa_nodes, (c, d)):
        final = finished(spsa_nodes, "spsa", "SPSA on digits to finish")
        assert final[0]["final_hash"] == final[1]["final_hash"] and final[0]["participants"] == 2
        assert final[0]["checkpoint"]["round"] == 4 and final[0]["checkpoint"]["hash"] == final[0]["final_hash"]
        for s in finished((c, d), "sapo", "SAPO on reasoning-gym to finish"):
            assert s["round"] == 8 and s["external_items_scored"] > 0 and s.get("rejected_malformed", 0) == 0
            assert s["checkpoint"]["round"] == 8
        meta = checkpoint.read_meta(checkpoint.latest(c.data_dir, "sapo"))
        assert meta["task"] == "swarmd.protocols.tasks.rgym:make_task" and meta["round"] == 8


@pytest.mark.beside
def test_the_tiny_gpt_is_evaluated_on_the_device_its_model_lives_on():
    """Found on an H200 (the CPU and GPU SPSA test below): the tiny GPT's evaluation drew its batches on the CPU
    while the model was on the GPU, so DiLoCo and SPSA on the default task failed with device = "cuda". Checked on
    the meta device, which any machine has."""
    seen = []

    class Probe(tinylm.TinyGPT):
        def loss(self, batch):
            seen.append(batch.device)
            return torch.zeros(())

    tinylm.evaluate(Probe().to("meta"), tinylm.encode_text("the cat sat. " * 500), batches=3)
    assert seen == [torch.device("meta")] * 3


@pytest.mark.swarm
@pytest.mark.timeout(240)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the GPU path runs where one is")
def test_diloco_on_a_cuda_gpu(tmp_path):
    path = config(tmp_path, task=f"{EXAMPLE}:make_task", rounds=2, h=10)
    path.write_text(path.read_text().replace('device = "cpu"', 'device = "cuda"'))
    swarm = Swarm(tmp_path / "nodes", config=path)
    try:
        nodes = swarm.start_chain(2, members_within=None)
        final = wait_for(lambda: all(diloco(n)["state"] == "done" for n in nodes) and [diloco(n) for n in nodes],
                         180, "2 nodes to finish on the GPU")
        assert final[0]["final_hash"] == final[1]["final_hash"] and final[0]["device"].startswith("cuda")
        assert final[0]["losses"][-1][1] < final[0]["losses"][0][1] + 1e-6
    finally:
        swarm.close()


@pytest.mark.swarm
@pytest.mark.timeout(240)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the GPU path runs where one is")
def test_spsa_and_sapo_on_a_cuda_gpu(tmp_path):
    with spsa_and_sapo(tmp_path, '[loops.spsa]\nrun = "d"\ntask = "digits"\nsteps = 50\nwindow = 25\n'
                                 'min_peers = 2\nlr = 1e-2\neps = 1e-2\ndevice = "cuda"\n'
                                 '[loops.spsa.task_options]\nhidden = 32\n',
                       '[loops.sapo]\nrun = "g"\ntask = "arith"\nrounds = 4\nmin_peers = 2\nquestions = 4\n'
                       'completions = 4\nlocal = 2\nexternal = 2\ndevice = "cuda"\n') as (spsa_nodes, sapo_nodes):
        final = finished(spsa_nodes, "spsa", "SPSA on the GPU to finish")
        assert final[0]["final_hash"] == final[1]["final_hash"] and final[0]["device"].startswith("cuda")
        for s in finished(sapo_nodes, "sapo", "SAPO on the GPU to finish"):
            assert s["round"] == 4 and s["external_items_scored"] > 0 and s["device"].startswith("cuda")


@pytest.mark.swarm
@pytest.mark.timeout(240)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the GPU path runs where one is")
def test_spsa_peers_on_the_cpu_and_a_cuda_gpu_pass_each_others_audits(tmp_path):
    """A CPU peer and a GPU peer of one run re-probe every step of each other (the GPU's kernels round the losses
    differently): no honest byte is convicted and both end on the same weights."""
    table = ('[loops.spsa]\nrun = "mixed"\ntask = "tinygpt"\nsteps = 96\nwindow = 24\nmin_peers = 2\n'
             'audit_peers = 8\naudit_steps = 24\ndevice = "{}"\n')
    cpu = loop_config(tmp_path / "cpu.toml", table.format("cpu"))
    gpu = loop_config(tmp_path / "gpu.toml", table.format("cuda"))
    swarm = Swarm(tmp_path / "nodes", config=cpu)
    try:
        a = swarm.start("a")
        b = swarm.start("b", config=gpu, bootstrap=[a.tcp_addr])
        final = finished((a, b), "spsa", "a CPU and a GPU SPSA peer to finish")
        assert final[0]["final_hash"] == final[1]["final_hash"] and final[1]["device"].startswith("cuda")
        for s in final:
            assert s["audits"] == "on" and s["audited_steps"] >= 72, s
            assert s.get("rejected_audit", 0) == 0 and s["convicted"] == {}, s
    finally:
        swarm.close()
