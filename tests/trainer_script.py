"""An ordinary Hugging Face Trainer run turned into a DiLoCo peer by one line (tests/test_api.py).

    python trainer_script.py <data dir> <min peers> [bootstrap multiaddr ...]
"""

import json
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import swarmd

data_dir, min_peers, bootstrap = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
node = swarmd.Node(config=os.environ["SWARMD_TEST_CONFIG"], data_dir=data_dir, bootstrap=bootstrap)
node.start()
print(json.dumps({"addresses": node.addresses, "url": node.status_url}), flush=True)


class Copying(torch.utils.data.Dataset):
    """Sequences that repeat their first half: a task a one-layer model learns in a few dozen steps."""

    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i * 7919 + len(data_dir))
        half = torch.randint(0, 64, (8,), generator=g)
        ids = torch.cat([half, half])
        return {"input_ids": ids, "labels": ids}


torch.manual_seed(0)  # every peer builds the same initial weights
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
args = TrainingArguments(output_dir=os.path.join(data_dir, "trainer"), max_steps=1000, learning_rate=3e-3,
                         per_device_train_batch_size=8, logging_steps=5, save_strategy="no", report_to=[],
                         use_cpu=True, disable_tqdm=True)
callback = swarmd.DiLoCoCallback(node, run="trainer-test", sync_every=5, rounds=4, settings={"min_peers": min_peers})
trainer = Trainer(model=model, args=args, train_dataset=Copying(), callbacks=[callback])
result = trainer.train()
print(json.dumps({"final": callback.diloco.final_hash, "rounds": callback.diloco.rounds_done,
                  "steps": trainer.state.global_step, "loss": result.training_loss}), flush=True)
sys.stdin.read()  # the node keeps serving the final weights until told to stop
node.close()
