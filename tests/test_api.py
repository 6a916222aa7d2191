"""The Python API as a researcher uses it: ``import swarmd`` in a script of their own, in a folder that has a
``configs`` package and a ``node.py`` of its own, DiLoCo wrapped around the script's loop across real processes;
kill -9 and restart; export and reload; bad input answered in one line."""

import http.client
import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

from swarmproc import LOCAL_CONFIG, http_get, run_cli, wait_for

HERE = Path(__file__).resolve().parent

USER_CONFIGS = """
OURS = True
LR = 1e-2
SYNC_EVERY = 10
"""

USER_NODE = """
import torch

OURS = True


class TinyNet(torch.nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))

    def forward(self, x):
        return self.body(x)


TARGET = torch.linspace(-1, 1, 8)


def batches(seed):
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(32, 8, generator=g)
        yield x, (x * TARGET).sum(1, keepdim=True)


def evaluate(model):
    g = torch.Generator().manual_seed(12345)
    x = torch.randn(256, 8, generator=g)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), (x * TARGET).sum(1, keepdim=True)))
"""


def user_folder(root: Path) -> Path:
    """The script's folder: train.py, configs/ (a package), node.py: names of swarmd's own folders, which a user's
    script is free to use."""
    folder = root / "project"
    (folder / "configs").mkdir(parents=True)
    (folder / "configs" / "__init__.py").write_text(USER_CONFIGS)
    (folder / "node.py").write_text(USER_NODE)
    shutil.copy(HERE / "api_script.py", folder / "train.py")
    return folder


class Script:
    """One run of the user's script: a process of its own, its stdout's JSON lines read as they come."""

    def __init__(self, folder: Path, data_dir: Path, args: list, bootstrap: list[str] = (),
                 script: str = "train.py", env: dict | None = None):
        env = {**os.environ, "SWARMD_TEST_CONFIG": str(LOCAL_CONFIG), "PYTHONUNBUFFERED": "1", **(env or {})}
        env.pop("PYTHONPATH", None)  # the script sees what a user's would: its own folder, and swarmd installed
        self.log = open(data_dir.parent / f"{data_dir.name}.log", "ab")
        self.proc = subprocess.Popen([sys.executable, script, str(data_dir), *map(str, args), *bootstrap],
                                     cwd=folder, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log)
        self.lines: list[dict] = []
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def read(self, timeout: float) -> dict:
        """The script's next JSON line (AssertionError if it exits first or prints none in time)."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the script printed nothing in {timeout} s") from None
        if line is None:
            raise AssertionError(f"the script exited ({self.proc.wait()}) without a line")
        self.lines.append(line)
        return line

    def _read_stdout(self) -> None:
        """Every line the script prints, in a thread of its own (a selector on the pipe would miss lines that a
        buffered read already took in); lines that are not ours (a Trainer prints its logs) are passed over."""
        for raw in self.proc.stdout:
            if raw.startswith(b'{"'):
                self._lines.put(json.loads(raw))
        self._lines.put(None)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        self.kill()
        self.log.close()


@pytest.mark.swarm
@pytest.mark.timeout(420)
def test_a_script_of_its_own_trains_across_4_processes_resumes_after_kill_9_and_exports(tmp_path):
    folder = user_folder(tmp_path)
    rounds = 40
    scripts: list[Script] = []
    try:
        first = Script(folder, tmp_path / "d0", [rounds, 4])
        scripts.append(first)
        boot = [a for a in first.read(120)["addresses"] if "/tcp/" in a][:1]
        for i in range(1, 4):
            scripts.append(Script(folder, tmp_path / f"d{i}", [rounds, 4], boot))
        urls = [s.read(120)["url"] if s is not first else first.lines[0]["url"] for s in scripts]

        def diloco(url):
            return http_get(url + "/status")["services"]["diloco"]

        # the run shows in each node's /status like any other; kill -9 one peer a few rounds in
        wait_for(lambda: all(diloco(u)["round"] >= 3 for u in urls), 180, "three rounds on every peer")
        victim = scripts[3]
        victim.kill()
        wait_for(lambda: diloco(urls[0])["round"] >= 5, 120, "the others going on without the killed peer")
        scripts[3] = Script(folder, tmp_path / "d3", [rounds, 4], boot)
        assert scripts[3].read(120)["url"]
        ends = [s.read(300) for s in scripts]
        assert len({e["final"] for e in ends}) == 1, ends  # every peer ends on the same weights
        # the restarted peer took up its own saved state (then, the swarm being further along, a peer's checkpoint)
        assert "resuming run api-test from our checkpoint" in (tmp_path / "d3.log").read_text()
        assert ends[3]["resumed"], ends[3]
        assert all(e["eval"] == ends[0]["eval"] for e in ends)

        # export the run's weights with the CLI and load them into a fresh model: the same evaluation
        for s in scripts:
            s.proc.stdin.close()
        for s in scripts:
            assert s.proc.wait(60) == 0
        out = tmp_path / "w.safetensors"
        done = run_cli("export", "--data-dir", str(tmp_path / "d0"), "--out", str(out), timeout=120)
        assert done.returncode == 0, done.stderr
        from safetensors.torch import load_file

        sys.path.insert(0, str(folder))
        try:
            import node as user_node  # the script's module, loaded from its folder for this check only
        finally:
            sys.path.remove(str(folder))
            sys.modules.pop("node", None)
        torch.manual_seed(0)
        model = user_node.TinyNet()
        untrained = user_node.evaluate(model)
        model.load_state_dict(load_file(str(out)))
        assert user_node.evaluate(model) == ends[0]["eval"] < 0.5 * untrained  # the swarm's weights, trained
    finally:
        for s in scripts:
            s.close()


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_a_peer_with_another_model_is_told_in_one_line(tmp_path):
    folder = user_folder(tmp_path)
    scripts: list[Script] = []
    try:
        scripts.append(Script(folder, tmp_path / "d0", [4, 2]))
        boot = [a for a in scripts[0].read(120)["addresses"] if "/tcp/" in a][:1]
        scripts.append(Script(folder, tmp_path / "d1", [4, 2], boot, env={"TEST_WIDTH": "16"}))
        scripts[1].read(120)
        assert scripts[1].proc.wait(120) != 0
        log = (tmp_path / "d1.log").read_text()
        said = [line for line in log.splitlines() if line.startswith("swarmd.training.SwarmError: ")]
        assert said and said[0].startswith("swarmd.training.SwarmError: swarmd.DiLoCo: run 'api-test' stopped: "), log
        assert "model parameter layout" in said[0], said
    finally:
        for s in scripts:
            s.close()


def _two_trainers(tmp_path: Path, source: str, name: str) -> list[dict]:
    """Two peers running the trainer script ``source`` (copied into a project folder as ``name``), the second
    bootstrapped from the first: what each printed at its end."""
    folder = tmp_path / "project"
    folder.mkdir()
    shutil.copy(HERE / source, folder / name)
    peers: list[Script] = []
    try:
        peers.append(Script(folder, tmp_path / "a", [2], script=name))
        boot = [a for a in peers[0].read(120)["addresses"] if "/tcp/" in a][:1]
        peers.append(Script(folder, tmp_path / "b", [2], boot, script=name))
        peers[1].read(120)
        return [p.read(200) for p in peers]
    finally:
        for p in peers:
            p.close()


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_a_transformers_trainer_with_the_callback_is_a_diloco_peer(tmp_path):
    ends = _two_trainers(tmp_path, "trainer_script.py", "train_hf.py")
    assert ends[0]["final"] == ends[1]["final"] is not None, ends  # one model, trained by two Trainers
    assert all(e["rounds"] == 4 and e["steps"] == 20 for e in ends), ends  # the callback ended training


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_a_lightning_trainer_with_the_callback_is_a_diloco_peer(tmp_path):
    """Two Lightning fits of one module, each with the callback and two batches accumulated per optimizer step:
    they end on one model, after exactly rounds x sync_every optimizer steps (twice as many batches)."""
    ends = _two_trainers(tmp_path, "lightning_script.py", "train_pl.py")
    assert ends[0]["final"] == ends[1]["final"] is not None, ends  # one model, trained by two Trainers
    assert all(e["rounds"] == 4 and e["steps"] == 20 and e["batches"] == 40 for e in ends), ends
    assert all(e["state"] == "done" for e in ends), ends
    # each round's loss is the mean of the losses the callback reported from the training steps' outputs
    assert all(len(e["losses"]) == 4 and e["losses"][-1][1] < e["losses"][0][1] for e in ends), ends


@pytest.mark.beside
@pytest.mark.timeout(120)
def test_import_swarmd_puts_one_name_on_the_path_and_leaves_torch_out(tmp_path):
    code = textwrap.dedent("""
        import importlib.util, sys
        import swarmd
        from swarmd.node.config import load_config
        load_config(None)  # swarmd's own default.toml, whatever configs/ the working directory has
        heavy = any(m in sys.modules for m in ("torch", "lightning", "transformers"))
        print(heavy, sorted(n for n in ("node", "dht", "crdt", "transport", "protocols", "configs")
                            if importlib.util.find_spec(n) is not None))
    """)
    (tmp_path / "elsewhere").mkdir()
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path / "elsewhere", capture_output=True, text=True,
                         timeout=100, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "False []"


@pytest.mark.beside
@pytest.mark.timeout(120)
def test_bad_input_gets_a_one_line_error_naming_what_is_wrong(tmp_path):
    import swarmd

    node = swarmd.Node(config=LOCAL_CONFIG, data_dir=tmp_path / "d")
    model = torch.nn.Linear(4, 1)
    other = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        (dict(model=[model], inner_optimizer=opt, sync_every=5), TypeError, "model must be a torch.nn.Module"),
        (dict(model=model, inner_optimizer="adam", sync_every=5), TypeError, "inner_optimizer must be a torch.optim"),
        (dict(model=model, inner_optimizer=torch.optim.SGD(other.parameters(), lr=0.1), sync_every=5), ValueError,
         "not the model's trainable parameters"),
        (dict(model=model, inner_optimizer=torch.optim.SGD([model.weight], lr=0.1), sync_every=5), ValueError,
         "are not in inner_optimizer"),
        (dict(model=model, inner_optimizer=opt, sync_every=0), ValueError, "sync_every must be an integer >= 1"),
        (dict(model=model, inner_optimizer=opt, sync_every=5, overlap=5), ValueError, "overlap (5) must be below"),
        (dict(model=model, inner_optimizer=opt, sync_every=5, settings={"codec": "zip"}), ValueError, "codec"),
        (dict(model=model, inner_optimizer=opt, sync_every=5, settings={"min_peer": 4}), ValueError,
         "min_peer: unknown setting"),
        (dict(model=model, inner_optimizer=opt, sync_every=5, settings={"inner_lr": 1.0}), ValueError,
         "the script's own"),
        (dict(model=model, inner_optimizer=opt, sync_every=5, settings={"inner_steps": 3}), ValueError,
         "given by the argument 'sync_every'"),
    ]
    for kwargs, error, words in cases:
        with pytest.raises(error) as caught:
            swarmd.DiLoCo(node, run="r", **kwargs)
        assert words in str(caught.value) and "\n" not in str(caught.value), (kwargs, caught.value)
    with pytest.raises(TypeError, match="node must be a swarmd.Node"):
        swarmd.DiLoCo("node", run="r", model=model, inner_optimizer=opt, sync_every=5)
    with pytest.raises(ValueError, match="swarmd.Node: .*listen"):
        swarmd.Node(config=LOCAL_CONFIG, data_dir=tmp_path / "d", settings=["network.listen=5"])
    with pytest.raises(ValueError, match="swarmd.SPSA: task .* lacks"):
        swarmd.SPSA(node, object(), run="s")


@pytest.mark.beside
@pytest.mark.timeout(120)
def test_the_trainer_callbacks_answer_bad_input_in_one_line(tmp_path):
    """Both callbacks check their arguments when built, as DiLoCo does; the Lightning one checks the module and the
    optimizers Lightning configured when fit starts, before the run is entered (the node is never started)."""
    import lightning.pytorch as pl

    import swarmd

    node = swarmd.Node(config=LOCAL_CONFIG, data_dir=tmp_path / "d")
    for callback in (swarmd.DiLoCoCallback, swarmd.DiLoCoLightningCallback):
        name = f"swarmd.{callback.__name__}"
        cases = [
            (dict(sync_every=0), ValueError, f"{name}: sync_every must be an integer >= 1, not 0"),
            (dict(sync_every=5, overlap=5), ValueError, f"{name}: overlap (5) must be below sync_every (5)"),
            (dict(sync_every=5, settings={"min_peer": 4}), ValueError, f"{name}: min_peer: unknown setting"),
            (dict(sync_every=5, settings={"codec": "zip"}), ValueError, f"{name}: unknown codec 'zip'"),
            (dict(sync_every=5, settings={"inner_lr": 1.0}), ValueError, "the script's own"),
            (dict(sync_every=5, evaluate="loss"), TypeError, f"{name}: evaluate must be a function"),
        ]
        for kwargs, error, words in cases:
            with pytest.raises(error) as caught:
                callback(node, run="r", **kwargs)
            assert words in str(caught.value) and "\n" not in str(caught.value), (kwargs, caught.value)
        with pytest.raises(TypeError, match=f"{name}: node must be a swarmd.Node"):
            callback("node", run="r", sync_every=5)

    class Module(pl.LightningModule):
        def __init__(self, optimizers):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.other = torch.nn.Linear(4, 1, bias=False).requires_grad_(False)
            self.make = optimizers
            self.automatic_optimization = len(optimizers(self)) == 1

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return self.make(self)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    modules = [
        (Module(lambda m: [torch.optim.SGD(m.layer.parameters(), lr=0.1), torch.optim.SGD(m.layer.parameters(),
                                                                                       lr=0.1)]),
         "swarmd.DiLoCoLightningCallback: configure_optimizers gave 2 optimizers"),
        (Module(lambda m: [torch.optim.SGD([m.layer.weight, m.other.weight], lr=0.1)]),
         "swarmd.DiLoCoLightningCallback: inner_optimizer steps 1 tensor(s) that are not the model's trainable"),
        (Module(lambda m: [torch.optim.SGD([m.layer.weight], lr=0.1)]),
         "swarmd.DiLoCoLightningCallback: 1 trainable parameter(s) of the model are not in inner_optimizer"),
    ]
    for module, words in modules:
        callback = swarmd.DiLoCoLightningCallback(node, run="r", sync_every=5)
        trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
        with pytest.raises(ValueError) as caught:
            trainer.fit(module, data)
        assert str(caught.value).startswith(words) and "\n" not in str(caught.value), caught.value
        assert callback.diloco is None and not node.running  # refused before the run was entered


@pytest.mark.timeout(180)
def test_spsa_runs_from_a_script_with_a_task_object_to_the_end(tmp_path):
    """The task-driven loops' Python entry point: an SPSA run of a task object (the seam's duck-typed contract) on
    an embedded node, from start to done, shown in the node's /status like a configured loop."""
    import swarmd
    from swarmd.protocols.tasks.regression import RegressionTask

    node = swarmd.Node(config=LOCAL_CONFIG, data_dir=tmp_path / "d")
    with node:
        run = swarmd.SPSA(node, RegressionTask(dim=16, batch=8, noise=0.0), run="api-spsa",
                          settings={"steps": 64, "window": 16, "eval_every": 1})
        run.wait(timeout=150)
        view = node.status()["services"]["spsa"]
        assert view["state"] == "done" and view["step"] >= 64, view
        assert node.status()["loops"]["spsa/api-spsa"]["state"] == "done"


def _ask(url: str, method: str, path: str, headers: dict | None = None) -> tuple[int, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.mark.timeout(180)
def test_a_loop_attached_after_the_node_started_serves_its_routes_behind_the_guard(tmp_path, caplog):
    """A script starts its node, then attaches a run: the run's own routes (SAPO's /sapo/history) are served on
    the node's endpoint like those of a configured loop, and the endpoint's guard stands in front of them."""
    import swarmd

    node = swarmd.Node(config=LOCAL_CONFIG, data_dir=tmp_path / "d")
    with node:
        url = node.status_url
        assert _ask(url, "GET", "/sapo/history")[0] == 404  # no run yet
        run = swarmd.SAPO(node, "arith", run="late", settings={"rounds": 2, "questions": 2, "completions": 2,
                                                               "local": 2, "external": 0})
        run.start()
        run.wait(timeout=150)
        status, body = _ask(url, "GET", "/sapo/history")
        assert status == 200 and json.loads(body)["run"] == "late" and len(json.loads(body)["rounds"]) == 2, body
        assert _ask(url, "HEAD", "/sapo/history")[0] == 200
        port = urlsplit(url).port
        assert _ask(url, "GET", "/sapo/history", {"Host": f"evil.example:{port}"})[0] == 421  # DNS rebinding
        assert _ask(url, "GET", "/sapo/history", {"Origin": "http://evil.example"})[0] == 403
        assert _ask(url, "POST", "/sapo/history")[0] == 401  # a write without the token, even to a read route
        token = (tmp_path / "d" / "http.token").read_text()
        assert _ask(url, "POST", "/sapo/history", {"Authorization": f"Bearer {token}"})[0] == 405
        assert _ask(url, "GET", "/status")[0] == 200  # the node's own routes are served as before
        # a second run claiming the same route: the first keeps it, and the log says so
        with caplog.at_level(logging.WARNING, logger="swarmd.node.core"):
            swarmd.SAPO(node, "arith", run="later", settings={"rounds": 1, "questions": 2, "completions": 2,
                                                              "local": 2, "external": 0}).start()
        assert json.loads(_ask(url, "GET", "/sapo/history")[1])["run"] == "late"
        assert "GET /sapo/history already served by another service" in caplog.text, caplog.text
        metrics = http_get(url + "/metrics")
        for kind in ("bad_host", "foreign_origin", "unauthorized"):
            line = next(x for x in metrics.splitlines() if f'kind="http_{kind}"' in x)
            assert float(line.split()[-1]) >= 1, line
