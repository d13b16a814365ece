"""The policy: a Ray actor holding the trained model (FSDP2 over a gloo/NCCL group, as train/ shards it; full weights
or a LoRA adapter on the frozen base, as train/ does either), its optimizer and, when the KL term is on, the frozen
reference. It scores tokens, takes GRPO steps, hands out its full weights for the rollout engines (a LoRA policy's
adapter folded into them), and saves/loads checkpoints (train/checkpoint.py's DCP layout).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from core.collector import heavy_imports, preload

with heavy_imports():  # a policy worker's start is mostly these imports (core/collector.py)
    import torch

from posttrain.grpo.loss import grpo_loss
from train.config import LoraConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def padded_batch(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]:
    """(prompt ids, completion ids) rows -> input ids [B, L] right-padded, attention mask [B, L], and the mask of
    the completion tokens' target positions [B, L-1] (which shifted logits score a completion token)."""
    length = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), length), dtype=torch.long)
    target = torch.zeros((len(rows), length - 1), dtype=torch.bool)
    for i, (p, c) in enumerate(rows):
        seq = p + c
        ids[i, :len(seq)] = torch.tensor(seq)
        attn[i, :len(seq)] = 1
        target[i, len(p) - 1:len(seq) - 1] = True
    return ids, attn, target


def token_logprobs(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token under `model`: [B, L-1] (position t scores token t+1)."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


class PolicyWorker:
    """One rank of the policy (`world_size` ranks form one FSDP2 group). Use `policy_actor` to start it."""

    def __init__(self, model_dir: str, rank: int, world_size: int, master: str, lr: float, weight_decay: float,
                 clip_eps: float, beta: float, threads: int, seed: int, lora: LoraConfig | None = None):
        # The model's code, in the actor only: the GRPO driver imports this module too, and needs no transformers.
        preload("transformers.modeling_utils", "transformers.models.auto.modeling_auto")
        import torch.distributed as dist

        from train.fsdp import build_sharded_model, load_model

        torch.manual_seed(seed)
        torch.set_num_threads(threads)
        addr, port = master.rsplit(":", 1)
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=port)
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        self.rank, self.model_dir = rank, model_dir
        self.lora = lora if lora is not None and lora.enabled else None
        self.model = build_sharded_model(model_dir, torch.device("cpu"), lora=self.lora, base_model_ref=model_dir)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr,
                                           betas=(0.9, 0.99), weight_decay=weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: 1.0)
        self.clip_eps, self.beta = clip_eps, beta
        self.reference = None
        if beta:
            self.reference = load_model(model_dir, "sdpa", False).eval()
            self.reference.requires_grad_(False)
        from transformers import AutoTokenizer

        self.pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
        self.step = 0

    def train_step(self, rows: list[tuple[list[int], list[int]]], advantages: list[float], micro_batch: int
                   ) -> dict[str, float]:
        """One optimizer step of GRPO over this rank's `rows` (prompt ids, completion ids) with their advantages,
        in micro-batches of `micro_batch` rows (gradients accumulated). The sampling policy is the current one
        (one update per rollout batch, as TRL's num_iterations=1), so `old` log-probs are the current ones
        detached and the ratio starts at 1."""
        start = time.perf_counter()
        self.model.train()
        totals = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0}
        chunks = [range(i, min(i + micro_batch, len(rows))) for i in range(0, len(rows), micro_batch)]
        for chunk in chunks:
            ids, attn, target = padded_batch([rows[i] for i in chunk], self.pad_id)
            adv = torch.tensor([advantages[i] for i in chunk], dtype=torch.float32)
            logps = token_logprobs(self.model, ids, attn)
            ref = None
            if self.reference is not None:
                with torch.no_grad():
                    ref = token_logprobs(self.reference, ids, attn)
            loss, parts = grpo_loss(logps, logps.detach(), adv, target, self.clip_eps, self.beta, ref)
            (loss * len(chunk) / len(rows)).backward()
            totals["loss"] += float(loss) * len(chunk) / len(rows)
            for k in ("kl", "clip_fraction"):
                totals[k] += parts[k] * len(chunk) / len(rows)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {**totals, "train_seconds": time.perf_counter() - start}

    def full_weights(self) -> dict[str, Any]:
        """Collective: the unsharded weights (HF names; a LoRA policy's adapter folded in) as numpy arrays on rank 0
        ({} elsewhere); numpy so Ray's object store hands them to every rollout engine without a pickle copy per
        reader."""
        from train.export import full_state_dict
        from train.lora import merged_state_dict

        state = full_state_dict(self.model)
        if self.lora is not None and self.rank == 0:
            state = merged_state_dict(state, self.lora.alpha / self.lora.rank)
        return {k: v.numpy() for k, v in state.items()} if self.rank == 0 else {}

    def next_token_logprobs(self, prompt_ids: list[int], k: int) -> dict[int, float]:
        """The policy's log-probabilities of its `k` most likely next tokens after `prompt_ids` (the sync check)."""
        self.model.eval()
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([prompt_ids])).logits[0, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(lp, k)
        return {int(t): float(v) for t, v in zip(top.indices, top.values)}

    def save(self, directory: str) -> None:
        """Collective: model + optimizer shards and this step into `directory` (train/checkpoint.py)."""
        import torch.distributed as dist

        from train.checkpoint import TrainerState, save_checkpoint

        save_checkpoint(directory, self.model, self.optimizer,
                        TrainerState(step=self.step, world_size=dist.get_world_size()), self.rank)

    def load(self, directory: str) -> int:
        """Collective: restore model + optimizer from `directory`; returns its policy step."""
        from train.checkpoint import load_checkpoint

        self.step = load_checkpoint(directory, self.model, self.optimizer, self.scheduler, self.rank).step
        return self.step

    def pid(self) -> int:
        return os.getpid()


def policy_group(model_dir: str, world_size: int, cpus_per_worker: float, threads: int, lr: float,
                 weight_decay: float, clip_eps: float, beta: float, seed: int,
                 placements: list[dict[str, Any]] | None = None, lora: LoraConfig | None = None) -> list:
    """Start the policy's `world_size` ranks as Ray actors (one FSDP2 group)."""
    import ray

    master = f"127.0.0.1:{free_port()}"
    placements = placements or [{} for _ in range(world_size)]
    threads = threads or max(1, int(cpus_per_worker))
    cls = ray.remote(PolicyWorker)
    return [cls.options(num_cpus=cpus_per_worker, **placements[r]).remote(
        model_dir, r, world_size, master, lr, weight_decay, clip_eps, beta, threads, seed, lora)
        for r in range(world_size)]
