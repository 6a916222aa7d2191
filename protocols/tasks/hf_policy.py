"""SAPO with a Hugging Face ``transformers`` causal LM as the policy, on reasoning-gym or a ``verifiers`` environment.

The policy is any causal LM: a local ``save_pretrained`` directory (``pretrained = "/path"``, its tokenizer and chat
template with it; nothing is downloaded) or one built from a config (``model_type`` plus ``config`` overrides,
random init) with a byte-level BPE trained here on the environment's own questions and answers (``tokenizers``,
deterministic). Prompts are the environment's questions in the tokenizer's chat template (a minimal one where it
has none), after a system prompt. Each round it samples G completions per question with ``generate``
(``temperature``, ``top_p``, ``max_new_tokens``) and takes one GRPO step on the groups the loop picked
(``protocols.grpo.loss``: clipped ratio, and with ``beta`` > 0 the KL term to a frozen copy of the starting policy;
the adapters switched off where LoRA is on). ``lora_r`` > 0 trains LoRA adapters (``peft``) instead of the weights.
``sft_steps`` > 0 first fits the fresh policy to the environment's reference answers of its own questions (a
supervised warm-up, so rewards are not all zero from the start). ``swarmd export --pretrained DIR`` writes a
``save_pretrained`` directory with the tokenizer: adapters merged (``export_merged = true``) or kept (the adapter in
DIR, the base model in DIR/base).

Environments: ``env = "reasoning-gym"`` (``datasets`` as the reasoning-gym task's) or ``env = "verifiers:<module>"``
(``env_args``; ``protocols.tasks.verifiers_env``). Every receiver regenerates a question from its spec and scores
completions with the environment's own scorer. What travels is text: peers may run different models and tokenizers.
The wire bound (``max_completion`` characters, at most 4 bytes each) is part of the environment every peer of a run
shares; a receiver trains on at most ``max_new_tokens`` of its own tokens of a completion (the rest cut, counted).
TRL's GRPOTrainer owns generation, data and the optimizer loop, so only its loss shape is followed here.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import torch

from swarmd.protocols import grpo
from swarmd.protocols.tasks import rgym, verifiers_env

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SYSTEM_PROMPT = "Answer with the final answer only."
TINY_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "max_position_embeddings": 512, "tie_word_embeddings": True}


def _printable(text: str) -> bool:
    return all(c.isprintable() or c in "\n\t" for c in text)


class LmPolicy:
    """The policy the loop drives: ``generate``, ``step``, and ``model`` (saved in the loop's checkpoints)."""

    def __init__(self, task: LmTask, seed: int, device: str):
        from transformers import AutoConfig, AutoModelForCausalLM

        o, tok = task.opts, task.tokenizer
        self.o, self.tok, self.task = o, tok, task
        self.device = torch.device(device)
        dtype = getattr(torch, o["dtype"])
        if o["pretrained"]:
            model = AutoModelForCausalLM.from_pretrained(o["pretrained"], local_files_only=True, dtype=dtype)
        else:
            config = AutoConfig.for_model(o["model_type"], vocab_size=len(tok), **o["config"])
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.config.pad_token_id = tok.pad_token_id
        self.model = model.to(self.device).eval()
        self.rng = random.Random(seed)
        if o["sft_steps"]:
            self._warm_up()
        self.ref = None
        if o["lora_r"]:
            from peft import LoraConfig, get_peft_model

            targets = o["lora_targets"] if o["lora_targets"] == "all-linear" else list(o["lora_targets"])
            self.model = get_peft_model(self.model, LoraConfig(r=o["lora_r"], lora_alpha=o["lora_alpha"],
                                                               lora_dropout=0.0, target_modules=targets,
                                                               task_type="CAUSAL_LM")).eval()
        elif o["beta"]:
            self.ref = copy.deepcopy(self.model).requires_grad_(False)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=o["lr"],
                                     weight_decay=0.0)

    # ------------------------------------------------------------------ text <-> tokens
    def _prompt_ids(self, prompt: str) -> list[int]:
        messages = ([{"role": "system", "content": self.task.system_prompt}] if self.task.system_prompt else []) + [
            {"role": "user", "content": prompt}]
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tok(text, add_special_tokens=False)["input_ids"][-self.o["max_prompt_tokens"]:]

    def _completion_ids(self, text: str) -> tuple[list[int], bool]:
        """A completion in our tokens, at most ``max_new_tokens`` (and whether it was cut), ending with our end of
        text where it ended before that (what our own sampling would have produced)."""
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        cap = self.o["max_new_tokens"]
        if len(ids) >= cap:
            return ids[:cap], len(ids) > cap
        return ids + [self.tok.eos_token_id], False

    def _batch(self, rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded [prompt + completion] ids, their attention mask, and the mask of completion tokens in the
        shifted (next-token) positions."""
        width = max(len(p) + len(c) for p, c in rows)
        pad = self.tok.pad_token_id
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        att = torch.zeros((len(rows), width), dtype=torch.long)
        target = torch.zeros((len(rows), width - 1))
        for i, (p, c) in enumerate(rows):
            ids[i, :len(p) + len(c)] = torch.tensor(p + c)
            att[i, :len(p) + len(c)] = 1
            target[i, len(p) - 1:len(p) + len(c) - 1] = 1
        return ids.to(self.device), att.to(self.device), target.to(self.device)

    def _logprobs(self, model, ids: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
        return torch.gather(torch.log_softmax(logits, -1), 2, ids[:, 1:, None])[..., 0]

    # ------------------------------------------------------------------ the seam
    @torch.no_grad()
    def generate(self, prompts: list[str], g: int) -> list[list[str]]:
        rows = [self._prompt_ids(p) for p in prompts]
        width = max(len(r) for r in rows)
        pad = self.tok.pad_token_id
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=self.device)  # left-padded
        att = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.rng.randrange(1 << 62))  # our own stream: reproducible per peer and seed
            out = self.model.generate(input_ids=ids, attention_mask=att, do_sample=True, num_return_sequences=g,
                                      temperature=self.o["temperature"], top_p=self.o["top_p"], top_k=0,
                                      max_new_tokens=self.o["max_new_tokens"], pad_token_id=pad,
                                      eos_token_id=self.tok.eos_token_id)
        texts = self.tok.batch_decode(out[:, width:], skip_special_tokens=True)
        return [texts[i * g:(i + 1) * g] for i in range(len(prompts))]

    def step(self, groups: list[grpo.Group]) -> dict:
        """One GRPO update on the informative groups (micro-batches of ``micro_batch`` completions, one optimizer
        step per epoch); returns what it did."""
        groups = [grp for grp in groups if grp.informative]
        if not groups:
            return {"groups": 0, "loss": 0.0}
        rows, advs, cut = [], [], 0
        for grp in groups:
            prompt = self._prompt_ids(grp.prompt)
            for text, adv in zip(grp.completions, grpo.advantages(grp.rewards)):
                ids, was_cut = self._completion_ids(text)
                cut += was_cut
                rows.append((prompt, ids))
                advs.append(adv)
        mb = self.o["micro_batch"]
        chunks = []
        with torch.no_grad():
            for k in range(0, len(rows), mb):
                ids, att, mask = self._batch(rows[k:k + mb])
                old = self._logprobs(self.model, ids, att)
                ref = None
                if self.o["beta"]:
                    if self.ref is not None:
                        ref = self._logprobs(self.ref, ids, att)
                    else:
                        with self.model.disable_adapter():
                            ref = self._logprobs(self.model, ids, att)
                adv = torch.tensor(advs[k:k + mb], device=self.device)[:, None]
                chunks.append((ids, att, mask, old, ref, adv))
        tokens = sum(float(c[2].sum()) for c in chunks)
        total = 0.0
        for _ in range(self.o["epochs"]):
            self.opt.zero_grad(set_to_none=True)
            total = 0.0
            for ids, att, mask, old, ref, adv in chunks:
                value = grpo.loss(self._logprobs(self.model, ids, att), old, adv, mask, self.o["eps_low"],
                                  self.o["eps_high"], ref, self.o["beta"]) * (float(mask.sum()) / tokens)
                value.backward()
                total += value.item()
            self.opt.step()
        return {"groups": len(groups), "loss": total, "truncated": cut}

    def _warm_up(self) -> None:
        """``sft_steps`` AdamW steps of cross-entropy on the environment's reference answers to questions drawn
        from our own seed (nothing from the wire)."""
        env, o = self.task.env, self.o
        opt = torch.optim.AdamW(self.model.parameters(), lr=o["sft_lr"])
        for _ in range(o["sft_steps"]):
            rows = []
            for k in range(o["sft_batch"]):
                q = env.question(env.datasets[k % len(env.datasets)], self.rng.randrange(1 << 62), k % 64)
                rows.append((self._prompt_ids(q.prompt), self._completion_ids(env.reference(q))[0]))
            ids, att, mask = self._batch(rows)
            loss = -(self._logprobs(self.model, ids, att) * mask).sum() / mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


class LmTask:
    """The SAPO task (``protocols.task``): the environment's questions and scorer, and an ``LmPolicy`` per peer."""

    def __init__(self, env, opts: dict):
        self.env, self.opts = env, opts
        self.datasets = list(env.datasets)
        self.max_completion = opts["max_completion"]
        # what every peer of a run must share: the environment and the wire bound (the policy is each peer's own)
        self.environment = f"{env.environment} max_completion {opts['max_completion']}"
        self.system_prompt = getattr(env, "system_prompt", None) or opts["system_prompt"]
        self.tokenizer = self._tokenizer()

    def _tokenizer(self):
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        source = self.opts["tokenizer"] or self.opts["pretrained"]
        if source:
            if not Path(source).expanduser().is_dir():
                raise ValueError(f"model directory {source} does not exist")
            tok = AutoTokenizer.from_pretrained(str(Path(source).expanduser()), local_files_only=True)
        else:
            tok = PreTrainedTokenizerFast(tokenizer_object=self._train_bpe(), eos_token="<|endoftext|>",
                                          pad_token="<|pad|>")
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        if self.opts["chat_template"]:
            tok.chat_template = self.opts["chat_template"]
        elif not getattr(tok, "chat_template", None):
            tok.chat_template = CHAT_TEMPLATE
        return tok

    def _train_bpe(self):
        """A byte-level BPE on the environment's questions and reference answers (the same on every run)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        texts = [SYSTEM_PROMPT, self.opts["system_prompt"]]
        for k in range(256):
            q = self.env.question(self.env.datasets[k % len(self.env.datasets)], 1 + k // 64, k % 64)
            texts += [q.prompt, self.env.reference(q)]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=self.opts["vocab_size"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=SPECIALS)
        tok.train_from_iterator(texts, trainer=trainer)
        return tok

    def question(self, dataset: str, seed: int, index: int):
        return self.env.question(dataset, seed, index)

    def score(self, q, completion: str) -> float:
        return self.env.score(q, completion)

    def valid_completion(self, text: str) -> bool:
        return _printable(text)

    def policy(self, seed: int, device: str = "cpu") -> LmPolicy:
        return LmPolicy(self, seed, device)

    def export_pretrained(self, model, directory: str) -> None:
        """``swarmd export --pretrained DIR``: the model (adapters merged, or kept with the base in DIR/base) and
        the tokenizer with its chat template; loadable with from_pretrained."""
        if hasattr(model, "merge_and_unload"):  # a peft model
            if self.opts["export_merged"]:
                model = model.merge_and_unload()
            else:
                model.save_pretrained(directory)
                self.tokenizer.save_pretrained(directory)
                model = model.unload()
                directory = str(Path(directory) / "base")
        model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)


def make_task(env: str = "reasoning-gym", datasets: dict | list | None = None, env_args: dict | None = None,
              max_completion: int = 256, pretrained: str = "", tokenizer: str = "", model_type: str = "llama",
              config: dict | None = None, vocab_size: int = 512, chat_template: str = "",
              system_prompt: str = SYSTEM_PROMPT, dtype: str = "float32", temperature: float = 1.0, top_p: float = 1.0,
              max_new_tokens: int = 16, max_prompt_tokens: int = 256, lr: float = 1e-4, eps_low: float = 0.2,
              eps_high: float = 0.28, beta: float = 0.0, epochs: int = 1, micro_batch: int = 32, lora_r: int = 0,
              lora_alpha: int = 16, lora_targets: str | list = "all-linear", export_merged: bool = True,
              sft_steps: int = 0, sft_lr: float = 1e-3, sft_batch: int = 16) -> LmTask:
    if not (1 <= max_completion <= 1024 and 1 <= max_new_tokens <= 4096 and 8 <= max_prompt_tokens <= 32768
            and 0 < temperature <= 10 and 0 < top_p <= 1 and lr > 0 and beta >= 0 and 1 <= epochs <= 8
            and micro_batch >= 1 and lora_r >= 0 and sft_steps >= 0 and sft_batch >= 1 and vocab_size >= 300):
        raise ValueError("need 1 <= max_completion <= 1024, 1 <= max_new_tokens <= 4096, 8 <= max_prompt_tokens, "
                         "0 < temperature <= 10, 0 < top_p <= 1, lr > 0, beta >= 0, 1 <= epochs <= 8, "
                         "micro_batch >= 1, lora_r >= 0, sft_steps >= 0, vocab_size >= 300")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError("dtype must be float32, bfloat16 or float16")
    if pretrained and not Path(pretrained).expanduser().is_dir():
        raise ValueError(f"model directory {pretrained} does not exist")
    if env == "reasoning-gym":
        environment = rgym.Environment(rgym.datasets_table(datasets))
    elif env.startswith("verifiers:"):
        environment = verifiers_env.Environment(env.removeprefix("verifiers:"), dict(env_args or {}))
    else:
        raise ValueError(f"env must be 'reasoning-gym' or 'verifiers:<module>', not {env!r}")
    opts = dict(max_completion=max_completion, pretrained=str(Path(pretrained).expanduser()) if pretrained else "",
                tokenizer=tokenizer, model_type=model_type,
                config={**TINY_LLAMA, **(config or {})} if model_type == "llama" else dict(config or {}),
                vocab_size=vocab_size, chat_template=chat_template, system_prompt=system_prompt, dtype=dtype,
                temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                max_prompt_tokens=max_prompt_tokens, lr=lr, eps_low=eps_low, eps_high=eps_high, beta=beta,
                epochs=epochs, micro_batch=micro_batch, lora_r=lora_r, lora_alpha=lora_alpha,
                lora_targets=lora_targets, export_merged=export_merged, sft_steps=sft_steps, sft_lr=sft_lr,
                sft_batch=sft_batch)
    return LmTask(environment, opts)
