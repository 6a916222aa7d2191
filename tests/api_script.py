"""A researcher's own training script, as tests/test_api.py lays it out in a folder of its own: beside it a
``configs`` package and a ``node.py`` module of the script's (names swarmd's folders also have), a model and a loop
of its own, and swarmd wrapped around that loop. Prints one JSON line when its node listens and one when its run
is done; its node then serves until its standard input closes.

    python train.py <data dir> <rounds> <min peers> [bootstrap multiaddr ...]
"""

import json
import logging
import os
import sys

import torch

import configs  # the script's own package, not swarmd's
import node as mine  # the script's own module
import swarmd

data_dir, rounds, min_peers, bootstrap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
assert configs.OURS and mine.OURS, "the script's own modules are shadowed"
logging.basicConfig(level=logging.WARNING)
logging.getLogger("swarmd.protocols.diloco").setLevel(logging.INFO)

swarm = swarmd.Node(config=os.environ["SWARMD_TEST_CONFIG"], data_dir=data_dir, bootstrap=bootstrap)
swarm.start()
print(json.dumps({"addresses": swarm.addresses, "url": swarm.status_url}), flush=True)

torch.manual_seed(0)  # every peer builds the same initial weights (or loads the same file)
model = mine.TinyNet(int(os.environ.get("TEST_WIDTH", "32")))
opt = torch.optim.AdamW(model.parameters(), lr=configs.LR)
batches = mine.batches(seed=abs(hash(swarm.peer_id)) % 1000)
with swarmd.DiLoCo(swarm, run="api-test", model=model, inner_optimizer=opt, sync_every=configs.SYNC_EVERY,
                   rounds=rounds, evaluate=mine.evaluate,
                   settings={"min_peers": min_peers, "checkpoint_every": 1, "deadline_low": 2.0}) as run:
    while not run.done:
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        run.report_loss(loss)
    resumed = run.loop.resumed
print(json.dumps({"final": run.final_hash, "eval": mine.evaluate(model), "step": run.step,
                  "resumed": resumed and resumed.get("source")}), flush=True)
sys.stdin.read()  # the node keeps serving the final weights (to a peer that joins late) until told to stop
swarm.close()
