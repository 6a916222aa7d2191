"""An ordinary Lightning fit turned into a DiLoCo peer by one line (tests/test_api.py), with gradient accumulation.

    python lightning_script.py <data dir> <min peers> [bootstrap multiaddr ...]
"""

import json
import os
import sys

import lightning.pytorch as pl
import torch

import swarmd

data_dir, min_peers, bootstrap = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
node = swarmd.Node(config=os.environ["SWARMD_TEST_CONFIG"], data_dir=data_dir, bootstrap=bootstrap)
node.start()
print(json.dumps({"addresses": node.addresses, "url": node.status_url}), flush=True)

TARGET = torch.linspace(-1, 1, 8)


class Linear(torch.utils.data.Dataset):
    """A linear target this peer samples with its own seed (its data dir), as peers of a swarm hold other data."""

    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i * 7919 + ord(data_dir[-1]))
        x = torch.randn(8, generator=g)
        return x, (x * TARGET).sum(0, keepdim=True)


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.batches = 0

    def training_step(self, batch, batch_idx):
        self.batches += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


torch.manual_seed(0)  # every peer builds the same initial weights
module = Regressor()
callback = swarmd.DiLoCoLightningCallback(node, run="lightning-test", sync_every=5, rounds=4,
                                          settings={"min_peers": min_peers})
trainer = pl.Trainer(max_steps=1000, accumulate_grad_batches=2, accelerator="cpu", devices=1, logger=False,
                     log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=[callback])
trainer.fit(module, torch.utils.data.DataLoader(Linear(), batch_size=16))
status = callback.diloco.status()
print(json.dumps({"final": callback.diloco.final_hash, "rounds": callback.diloco.rounds_done,
                  "steps": trainer.global_step, "batches": module.batches, "state": status["state"],
                  "losses": status["losses"]}), flush=True)
sys.stdin.read()  # the node keeps serving the final weights until told to stop
node.close()
