"""A Hugging Face ``transformers`` causal LM on real text, offline.

The model is built from a config (``model_type`` plus ``config`` overrides, random init: no weights can be
downloaded here) or loaded from a local ``save_pretrained`` directory (``pretrained = "/path"``). The corpus is text
already on the machine: the Python standard library's own source (``corpus = "stdlib"``), or the ``.py`` / ``.txt``
/ ``.md`` files under a folder of the user's (``corpus = "/path"``); one file in ten (by a hash of its name) is held
out for validation. The tokenizer is the pretrained directory's, or a byte-level BPE trained here on the training
files with ``tokenizers`` (deterministic: every peer trains the same one, and its hash is part of the run's
fingerprint, so peers whose corpora differ are told so instead of training apart).

``pretrain_steps`` > 0 trains the freshly built model that many AdamW steps on the corpus first (a base model for
SPSA fine-tuning, rebuilt bit for bit by every peer on CPU); ``finetune = "tail"`` then gives SPSA the held-out
half of the training files (a shifted distribution) and perturbs only the last ``perturb_layers`` layers' weights.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Iterator

import torch

from swarmd.protocols.tasks import batch_seed

SUFFIXES = {".py", ".txt", ".md", ".rst"}


def _files(corpus: str) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"]) if corpus == "stdlib" else Path(corpus).expanduser()
    if not root.is_dir():
        raise ValueError(f"corpus {corpus!r} is not a folder")
    files = sorted(root.glob("*.py")) if corpus == "stdlib" else sorted(
        p for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file())
    if not files:
        raise ValueError(f"corpus {corpus!r} has no text files")
    return files


def _bucket(path: Path) -> int:
    return hashlib.blake2b(path.name.encode(), digest_size=2).digest()[0] % 10


class HfTextTask:
    def __init__(self, opts: dict):
        self.opts = opts
        files = _files(opts["corpus"])
        texts = {p: p.read_text(encoding="utf-8", errors="replace") for p in files}
        train = [p for p in files if _bucket(p) != 0]
        val = [p for p in files if _bucket(p) == 0] or files[:1]
        if opts["finetune"] == "tail":  # the base model pretrains on one half, SPSA fine-tunes on the other
            half = len(train) // 2
            self._pretrain_files, train = train[:half], train[half:]
        else:
            self._pretrain_files = train
        self.tokenizer = self._tokenizer([texts[p] for p in self._pretrain_files])
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.train = self._encode([texts[p] for p in train])
        self.pretrain_tokens = self.train if self._pretrain_files is train else self._encode(
            [texts[p] for p in self._pretrain_files])
        self.val = self._encode([texts[p] for p in val])
        self.corpus_id = hashlib.blake2b("\n".join(f"{p.name}:{len(texts[p])}" for p in files).encode(),
                                         digest_size=8).hexdigest()
        self.batch, self.seq_len = opts["batch"], opts["seq_len"]
        if len(self.train) < 4 * (self.seq_len + 1) or len(self.val) < self.seq_len + 1:
            raise ValueError("the corpus is too small for seq_len")

    def _tokenizer(self, texts: list[str]):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        source = self.opts["tokenizer"] or self.opts["pretrained"]
        if source:
            path = Path(source).expanduser()
            path = path / "tokenizer.json" if path.is_dir() else path
            if not path.is_file():
                raise ValueError(f"no tokenizer.json at {source}")
            return Tokenizer.from_file(str(path))
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=self.opts["vocab_size"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<|endoftext|>"])
        tok.train_from_iterator(texts, trainer=trainer)
        return tok

    def _encode(self, texts: list[str]) -> torch.Tensor:
        eot = self.tokenizer.token_to_id("<|endoftext|>")
        ids: list[int] = []
        for enc in self.tokenizer.encode_batch(texts):
            ids.extend(enc.ids)
            if eot is not None:
                ids.append(eot)
        return torch.tensor(ids, dtype=torch.long)

    # ------------------------------------------------------------------ the seam
    def model(self) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.opts["pretrained"]:
            model = AutoModelForCausalLM.from_pretrained(self.opts["pretrained"], local_files_only=True)
        else:
            config = AutoConfig.for_model(self.opts["model_type"], vocab_size=self.vocab_size,
                                          **self.opts["config"])
            model = AutoModelForCausalLM.from_config(config)
        if self.opts["pretrain_steps"]:
            self._pretrain(model)
        return model

    def _pretrain(self, model) -> None:
        opt = torch.optim.AdamW(model.parameters(), lr=self.opts["pretrain_lr"], weight_decay=0.01)
        g = torch.Generator().manual_seed(12345)
        model.train()
        for _ in range(self.opts["pretrain_steps"]):
            batch = _windows(self.pretrain_tokens, self.batch, self.seq_len, g)
            loss = self.loss(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        model.eval()

    def data(self, shard: int, seed: int) -> Iterator[torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + shard)
        while True:
            yield _windows(self.train, self.batch, self.seq_len, g)

    def batch_at(self, shard: int, seed: int, step: int) -> torch.Tensor:
        """The batch of ``shard`` at ``step``, a function of its arguments (SPSA re-probes another peer's step)."""
        return _windows(self.train, self.batch, self.seq_len, torch.Generator().manual_seed(batch_seed(seed, shard,
                                                                                                       step)))

    def loss(self, model, batch: torch.Tensor) -> torch.Tensor:
        return model(input_ids=batch, labels=batch).loss

    def evaluate(self, model) -> float:
        device = next(model.parameters()).device
        g = torch.Generator().manual_seed(777)
        losses = [self.loss(model, _windows(self.val, self.batch, self.seq_len, g).to(device)).item()
                  for _ in range(self.opts["eval_batches"])]
        return sum(losses) / len(losses)

    def perturbed(self, model) -> list[str]:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        if self.opts["finetune"] != "tail":
            return names
        layers = sorted({int(n.split(".layers.")[1].split(".")[0]) for n in names if ".layers." in n})
        keep = set(layers[-self.opts["perturb_layers"]:])
        return [n for n in names if ".layers." in n and int(n.split(".layers.")[1].split(".")[0]) in keep]

    def fingerprint(self) -> str:
        tok = hashlib.blake2b(self.tokenizer.to_str().encode(), digest_size=8).hexdigest()
        return f"tokenizer {tok} corpus {self.corpus_id}"

    def export_pretrained(self, model, directory: str) -> None:
        """``swarmd export --pretrained DIR``: the model and its tokenizer, loadable with from_pretrained."""
        from transformers import PreTrainedTokenizerFast

        model.save_pretrained(directory)
        PreTrainedTokenizerFast(tokenizer_object=self.tokenizer, eos_token="<|endoftext|>").save_pretrained(directory)


def _windows(tokens: torch.Tensor, batch: int, seq_len: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=g)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


SMALL_LLAMA = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 4, "max_position_embeddings": 512, "tie_word_embeddings": True}


def make_task(model_type: str = "llama", config: dict | None = None, pretrained: str = "", tokenizer: str = "",
              corpus: str = "stdlib", vocab_size: int = 4096, seq_len: int = 128, batch: int = 8,
              eval_batches: int = 8, pretrain_steps: int = 0, pretrain_lr: float = 1e-3, finetune: str = "",
              perturb_layers: int = 1) -> HfTextTask:
    if finetune not in ("", "tail"):
        raise ValueError("finetune must be '' or 'tail'")
    if not (256 <= vocab_size <= 1 << 20 and 8 <= seq_len <= 8192 and batch >= 1 and eval_batches >= 1):
        raise ValueError("need 256 <= vocab_size, 8 <= seq_len <= 8192, batch >= 1, eval_batches >= 1")
    opts = dict(model_type=model_type, config={**SMALL_LLAMA, **(config or {})} if model_type == "llama"
                else dict(config or {}), pretrained=pretrained, tokenizer=tokenizer, corpus=corpus,
                vocab_size=vocab_size, seq_len=seq_len, batch=batch, eval_batches=eval_batches,
                pretrain_steps=pretrain_steps, pretrain_lr=pretrain_lr, finetune=finetune,
                perturb_layers=perturb_layers)
    return HfTextTask(opts)
