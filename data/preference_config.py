"""The preference data stage's config: JSONL pairs (prompt or messages, chosen, rejected) -> a versioned dataset.

It is the `preferences` section of the DPO stage's config (posttrain/dpo_config.py); `prepare_preferences` takes it
alone too. Fields mirror the chat data stage's (data/config.py) where they mean the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from core.config import config_hash, require, to_dict

# Where or how to run, not what the data is: kept out of the dataset version.
NOT_IN_VERSION = ("output_uri", "overwrite", "tokenizer")


@dataclass
class PreferenceConfig:
    output_uri: str
    """Where versions go: `<output_uri>/<version>/{manifest.json,train/,eval/,rejects/,reference/}`."""
    inputs: list[str] = field(default_factory=list)
    """JSONL files or directories (local or s3://) of preference records."""
    tokenizer: str = ""
    """The tokenizer (path, s3://, models:/ ref); empty = the DPO stage's reference model's."""
    eval_inputs: list[str] = field(default_factory=list)
    """Records that form the eval split as they are; when given, no random split of `inputs` happens."""
    seq_len: int = 256
    """Tokens per answer row (prompt + answer); longer pairs are rejected as too_long."""
    eval_fraction: float = 0.1
    """Share of `inputs` pairs that go to eval, chosen by a hash of content and seed (ignored with eval_inputs)."""
    seed: int = 0
    dedup: bool = True
    """Drop exact duplicates of (prompt, chosen, rejected) after cleaning; an eval copy wins over a train copy."""
    max_reject_fraction: float = 0.05
    """The run fails (rejects still written, no manifest) when more records than this are rejected."""
    max_chars: int = 200_000
    unicode_form: Literal["NFC", "NFKC", "none"] = "NFC"
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    system_field: str = "system"
    lineage: dict[str, str] = field(default_factory=dict)
    """Where the pairs came from, recorded in the manifest (the flywheel names the model version and batch run)."""
    overwrite: bool = False
    """Rebuild a version whose manifest already exists (otherwise it is returned untouched)."""

    def __post_init__(self):
        require(bool(self.output_uri.strip()), "preferences.output_uri", "empty path")
        require(8 <= self.seq_len <= 1 << 20, "preferences.seq_len", f"{self.seq_len} is out of range (8 .. 1048576)")
        require(0.0 <= self.eval_fraction < 1.0, "preferences.eval_fraction", "must be in [0, 1)")
        require(0.0 <= self.max_reject_fraction <= 1.0, "preferences.max_reject_fraction", "must be in [0, 1]")
        require(self.max_chars >= 1, "preferences.max_chars", "must be >= 1")


def content_config_hash(cfg: PreferenceConfig) -> str:
    """The part of the config that decides the version's content."""
    return config_hash({k: v for k, v in to_dict(cfg).items() if k not in NOT_IN_VERSION})
