"""A task of your own for swarmd's DiLoCo loop: a character-level LSTM language model on text files of yours.

Name it in the config and start the nodes; nothing here imports swarmd:

    [loops.diloco]
    task = "examples/my_task.py:make_task"

    [loops.diloco.task_options]
    text = "/path/to/a/folder/of/text"     # default: a few modules of Python's standard library
"""

import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F


class CharLSTM(torch.nn.Module):
    def __init__(self, vocab: int, d: int, layers: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.lstm = torch.nn.LSTM(d, d, num_layers=layers, batch_first=True)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x):
        out, _ = self.lstm(self.embed(x))
        return self.head(out)


class MyTask:
    def __init__(self, text: str, d: int, layers: int, context: int, batch: int):
        folder = Path(text) if text else Path(sysconfig.get_paths()["stdlib"])
        files = sorted(folder.glob("*.py"))[:40] if not text else sorted(folder.rglob("*.txt"))
        if not files:
            raise ValueError(f"no text files in {folder}")
        corpus = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
        data = torch.tensor([min(ord(c), 127) for c in corpus], dtype=torch.long)  # ASCII, the rest as 127
        cut = int(len(data) * 0.9)
        self.train, self.val = data[:cut], data[cut:]
        self.d, self.layers, self.context, self.batch = d, layers, context, batch

    def model(self):
        """Called under a seeded RNG: every peer builds the same initial weights."""
        return CharLSTM(128, self.d, self.layers)

    def data(self, shard, seed):
        """This peer's batches, forever: shard is a number derived from the peer's id."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + shard)
        while True:
            starts = torch.randint(0, len(self.train) - self.context - 1, (self.batch,), generator=g)
            yield torch.stack([self.train[s:s + self.context + 1] for s in starts.tolist()])

    def loss(self, model, batch):
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def evaluate(self, model):
        """Validation loss (lower is better); run under torch.no_grad()."""
        device = next(model.parameters()).device
        g = torch.Generator().manual_seed(0)
        starts = torch.randint(0, len(self.val) - self.context - 1, (64,), generator=g)
        batch = torch.stack([self.val[s:s + self.context + 1] for s in starts.tolist()]).to(device)
        return self.loss(model, batch).item()

    def optimizer(self, params):
        """Optional: the inner optimizer (default: the loop's inner_optimizer, inner_lr and weight_decay)."""
        return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)

    def fragments(self, model, count):
        """Optional, for Streaming DiLoCo: which parameters sync together (default: in order, equal sizes)."""
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        return [names[i::count] for i in range(count)]


def make_task(text="", d=64, layers=1, context=64, batch=16):
    """The [loops.diloco.task_options] table arrives here as keyword arguments."""
    return MyTask(text, d, layers, context, batch)
