"""The reference model's log-probs of every pair, computed once per (preference version, reference) by Ray Data.

    <preference version>/reference/<reference digest>/manifest.json       the scored version DPO trains on
    <preference version>/reference/<reference digest>/{train,eval}/*.parquet   the pair rows + ref_chosen_logp,
                                                                           ref_rejected_logp (float64)

The digest is the sha256 digest of the reference model's files (core/weights_manifest.py), so a reference
whose bytes change gets new log-probs, and the same reference over the same pairs is scored once, however many DPO
runs (a beta or learning-rate search among them) train on it. The scored manifest is the preference manifest with
the new columns and split paths and a `reference` entry; its `version` stays the preference version's.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data import manifest as mf
from data.prepared import load_manifest, read_split
from core import storage, weights_manifest
from posttrain.dpo_loss import REF_COLUMNS

SPLITS = ("train", "eval")


@dataclass
class ScoredPreferences:
    manifest_uri: str
    reference_digest: str
    skipped: bool


class ReferenceScorer:
    """A Ray Data actor: the frozen reference model, loaded once, adds each pair's summed answer log-probs."""

    def __init__(self, model_uri: str, threads: int = 1):
        import torch
        from transformers import AutoModelForCausalLM

        local = model_uri
        if storage.is_remote(model_uri):
            local = storage.local_copy(model_uri, Path(tempfile.gettempdir()) / "rayline-models")
        torch.set_num_threads(threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).to(self.device).eval()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        from posttrain.dpo_loss import pair_logps

        tensors = {k: torch.as_tensor(np.stack(list(v)) if v.dtype == object else v) for k, v in batch.items()}
        with torch.no_grad():
            chosen, rejected = pair_logps(self.model, tensors, self.device, torch.float32)
        return {**batch, REF_COLUMNS[0]: chosen.double().cpu().numpy(), REF_COLUMNS[1]: rejected.double().cpu().numpy()}


def reference_digest(model_uri: str, registered: str = "") -> str:
    """The sha256 digest of the reference model's files (what names its log-probs in the preference version); with
    `registered` (a registered version's `rayline.weights_digest`), raises ManifestMismatch unless the files are
    those bytes, so the log-probs always come from the version lineage names."""
    if registered:
        return weights_manifest.verify(model_uri, registered, what="reference model")["digest"]
    return weights_manifest.build(model_uri)["digest"]


def score_reference(manifest_uri: str, model_uri: str, model_ref: str, batch_size: int = 16,
                    num_gpus: float = 0.0, digest: str = "") -> ScoredPreferences:
    """Add the reference's log-probs to the preference version at `manifest_uri` (once: an existing scored manifest
    for the same reference bytes is returned as it is). `model_ref` is how lineage names the reference; `digest`, its
    registered digest when it is a registered version (checked against the files)."""
    manifest = load_manifest(manifest_uri)
    digest = reference_digest(model_uri, digest)
    version_uri = manifest_uri.rsplit("/", 1)[0]
    out_uri = storage.join(version_uri, "reference", digest[:16])
    scored_uri = storage.join(out_uri, "manifest.json")
    if storage.exists(scored_uri):
        return ScoredPreferences(scored_uri, digest, True)
    if storage.exists(out_uri):
        storage.delete_tree(out_uri)  # an unfinished earlier pass
    base = out_uri if storage.is_remote(out_uri) else storage.resolve(out_uri)[1]
    splits = {}
    for split in SPLITS:
        ds = read_split(manifest_uri, split).map_batches(
            ReferenceScorer, fn_constructor_args=(model_uri,), batch_size=batch_size, batch_format="numpy",
            concurrency=1, num_cpus=1, num_gpus=num_gpus)
        fs, path = storage.resolve(storage.join(base, split))
        ds.write_parquet(path, filesystem=fs)
        splits[split] = {**manifest["splits"][split], "path": storage.join(base, split)}
    scored = {**manifest, "columns": [*manifest["columns"], *REF_COLUMNS], "splits": splits,
              "reference": {"model": model_ref, "uri": model_uri, "digest": digest},
              "preference_manifest": manifest_uri}
    mf.write_manifest(scored, scored_uri)
    return ScoredPreferences(scored_uri, digest, False)

