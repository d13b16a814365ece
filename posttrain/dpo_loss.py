"""The DPO loss (Rafailov et al. 2023, the sigmoid form) as an objective of the shared training loop (train/loop.py).

For a pair with policy log-probs pi_c, pi_r of the chosen and rejected answers and the frozen reference's ref_c, ref_r
(summed over the answer's tokens, given the prompt):

    loss = -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))

An evaluation also reports two measures that do not depend on beta, so runs of different betas (a search over it)
can be ranked on them: `eval_preference_accuracy`, the share of pairs whose log-ratio margin
(pi_c - ref_c) - (pi_r - ref_r) is above 0 (the policy prefers the chosen answer more than the reference does), and
`eval_logratio_margin`, that margin's mean in nats. The DPO loss itself is not comparable across betas: the same
margins give another loss at another beta.

The reference's log-probs come with the batch (`ref_chosen_logp`, `ref_rejected_logp`: computed once per dataset
version by posttrain/dpo_reference.py), so a step runs the policy alone: one forward over the pair's two rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from data.preferences import COLUMNS
from train.packed_batch import IGNORE_INDEX, model_inputs

REF_COLUMNS = ("ref_chosen_logp", "ref_rejected_logp")


def logratio_margins(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                     ref_rejected: torch.Tensor) -> torch.Tensor:
    """Per-pair margin of log-ratios (pi_c - ref_c) - (pi_r - ref_r) from summed sequence log-probs ([pairs] each)."""
    return (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)


def margin_losses(margins: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-pair sigmoid DPO loss -log sigmoid(beta * margin) from the log-ratio margins."""
    return -F.logsigmoid(beta * margins)


def answer_logps(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, lengths: torch.Tensor,
                 device: torch.device, mask_dtype: torch.dtype) -> torch.Tensor:
    """Summed log-prob of each row's labelled tokens ([rows]); rows are right-padded to `lengths`."""
    rows, seq = input_ids.shape
    positions = torch.arange(seq, device=device).expand(rows, seq)
    segments = (positions < lengths.to(device).unsqueeze(1)).long()  # 1 = token, 0 = padding
    batch = {"input_ids": input_ids, "position_ids": positions, "segment_ids": segments}
    logits = model(**model_inputs(batch, device, mask_dtype), use_cache=False).logits
    targets = F.pad(labels.to(device=device, dtype=torch.long)[:, 1:], (0, 1), value=IGNORE_INDEX)
    nll = F.cross_entropy(logits.float().transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none")
    return -nll.sum(dim=1)


def pair_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device,
               mask_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed answer log-probs under `model`, both answers in one forward pass."""
    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    lengths = torch.cat([batch["chosen_length"], batch["rejected_length"]])
    logps = answer_logps(model, ids.to(device=device, dtype=torch.long), labels, lengths, device, mask_dtype)
    return logps.chunk(2)


@dataclass(frozen=True)
class DpoObjective:
    """train.loop.Objective: the summed DPO loss of a batch of pairs, averaged over pairs; evaluations also report
    the beta-free preference accuracy and log-ratio margin."""

    beta: float
    eval_metrics = ("preference_accuracy", "logratio_margin")

    @property
    def batch_dtypes(self) -> dict[str, torch.dtype]:
        return {**{c: torch.int64 for c in COLUMNS}, **{c: torch.float64 for c in REF_COLUMNS}}

    def _margins(self, model, batch, device, mask_dtype) -> torch.Tensor:
        chosen, rejected = pair_logps(model, batch, device, mask_dtype)
        ref_c, ref_r = (batch[c].to(device=device, dtype=torch.float32) for c in REF_COLUMNS)
        return logratio_margins(chosen, rejected, ref_c, ref_r)

    def loss_sum(self, model, batch, device, mask_dtype) -> torch.Tensor:
        return margin_losses(self._margins(model, batch, device, mask_dtype), self.beta).sum()

    def eval_sums(self, model, batch, device, mask_dtype) -> dict[str, torch.Tensor]:
        margins = self._margins(model, batch, device, mask_dtype)
        return {"loss": margin_losses(margins, self.beta).sum(), "preference_accuracy": (margins > 0).sum(),
                "logratio_margin": margins.sum()}

    def count(self, batch) -> int:
        return int(batch["chosen_length"].shape[0])
