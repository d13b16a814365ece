"""The data stage end to end on the real local Ray cluster, on local disk and on s3:// (Swift).

Outputs are checked by content: shards are read back through the train stage's loader (`read_split`),
every packed segment is decoded and compared with the records that went in.
"""

import json
import os
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from data.config import Config
from data.prepared import COLUMNS, load_manifest, read_split
from data.records import RecordRules, Reject, content_bytes, parse_record
from data.tokens import load_tokenizer, read_tokenizer_files
from core import storage
from core.config import from_dict

SAMPLE_YAML = str(Path(__file__).resolve().parents[2] / "configs" / "data" / "sample.yaml")

MALFORMED_REASONS = {
    "invalid_json": 1, "missing_field:messages": 1, "wrong_type:messages": 1, "empty_text": 1,
    "wrong_type:content": 1, "bad_role": 1, "invalid_utf8": 1, "no_assistant_turn": 1, "too_long": 1,
    "not_an_object": 1,
}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(read_tokenizer_files(str(tiny_model_dir))[1])


@pytest.fixture(scope="module")
def dup_file(sample_corpus_dir, tmp_path_factory):
    """Copies of train records in another file, respelled so only normalisation makes them equal."""
    records = [json.loads(x) for x in (sample_corpus_dir / "train.jsonl").read_text().splitlines()[:40]]
    for r in records:
        r["id"] = "copy-" + r["id"]
        r["messages"][-1]["content"] = "  " + r["messages"][-1]["content"] + " \r\n"
    path = tmp_path_factory.mktemp("dups") / "dups.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def main(cfg):
    # Imported here: importing Ray before the local_stack fixture exports the stack's variables would
    # make Ray miss the loopback address and the auth token (it reads both once, at import).
    from data.prepare import main as prepare

    return prepare(cfg)


def config(**fields) -> Config:
    base = {"format": "chat", "seq_len": 128, "packing": "pack", "num_shards": 2, "max_reject_fraction": 0.05,
            "max_chars": 100_000, "seed": 0}
    return from_dict(Config, {**base, **fields}, "tests/data/test_prepare.py")


def rendered(paths, tok) -> list[str]:
    """The chat-template text of every valid record in `paths`, deduplicated on normalised content."""
    seen, out = set(), []
    for path in paths:
        for line in open(path, "rb").read().splitlines():
            content = parse_record(line, "jsonl", RecordRules())
            if isinstance(content, Reject) or content_bytes(content) in seen:
                continue
            seen.add(content_bytes(content))
            text = tok.apply_chat_template([{"role": r, "content": c} for r, c in content], tokenize=False)
            if len(tok(text, add_special_tokens=False)["input_ids"]) <= 128:
                out.append(text)
    return out


def decoded_segments(manifest_uri, split, tok) -> list[str]:
    texts = []
    for batch in read_split(manifest_uri, split).iter_batches(batch_size=256, batch_format="numpy"):
        assert set(batch) == set(COLUMNS)
        for ids, seg, labels, pos in zip(batch["input_ids"], batch["segment_ids"], batch["labels"], batch["position_ids"]):
            assert len(ids) == 128
            for s in range(1, seg.max() + 1):
                where = seg == s
                assert np.array_equal(pos[where], np.arange(where.sum()))
                answer = tok.decode(ids[where & (labels != -100)])
                text = tok.decode(ids[where])
                assert answer.endswith("<|im_end|>") and answer in text.split("assistant\n", 1)[1]
                texts.append(text)
    return texts


def test_local_end_to_end(ray_session, local_stack, sample_corpus_dir, tiny_model_dir, dup_file, tok, tmp_path):
    train, malformed, evalf = (sample_corpus_dir / f"{n}.jsonl" for n in ("train", "malformed", "eval"))
    cfg = config(inputs=[str(train), str(malformed), str(dup_file)], eval_inputs=[str(evalf)],
                 output_uri=str(tmp_path / "prepared"), tokenizer=str(tiny_model_dir))
    result = main(cfg)
    m = load_manifest(result.version_uri)
    assert m == load_manifest(result.manifest_uri) == result.manifest and not result.skipped
    assert m["version"] == result.version and result.manifest_uri == str(tmp_path / "prepared" / result.version / "manifest.json")
    # What a version holds, and nothing else: the shuffle's files (data/shuffle.py) are gone.
    assert sorted(os.listdir(result.version_uri)) == ["eval", "manifest.json", "rejects", "train"]

    # Counts: everything read is accounted for, each malformed record under its own reason.
    c = m["counts"]
    n_lines = sum(len(p.read_bytes().splitlines()) for p in (train, malformed, dup_file, evalf))
    assert c["read"] == n_lines and c["rejected_by_reason"] == MALFORMED_REASONS and c["rejected"] == 10
    assert c["read"] == c["rejected"] + c["deduplicated"] + c["written_examples"]

    # Rejects: one line each, with source, 1-based line, reason and the raw text.
    rejects = [json.loads(x) for f in storage.list_files(storage.join(result.version_uri, "rejects"))
               for x in storage.read_text(storage.join(result.version_uri, "rejects", f)).splitlines()]
    assert sorted(r["line"] for r in rejects) == list(range(1, 11)) and {r["source"] for r in rejects} == {str(malformed)}
    raw_lines = malformed.read_bytes().splitlines()
    for r in rejects:
        assert r["raw"] in (raw_lines[r["line"] - 1].decode("utf-8", "replace"), repr(raw_lines[r["line"] - 1]))
        assert r["detail"]

    # Shards decode back to exactly the unique valid records; eval is exactly eval.jsonl.
    assert Counter(decoded_segments(result.manifest_uri, "train", tok)) == Counter(rendered([train, dup_file], tok))
    assert sorted(decoded_segments(result.manifest_uri, "eval", tok)) == sorted(rendered([evalf], tok))
    assert c["deduplicated"] >= 40  # the respelled copies, plus the corpus's own repeats
    s = m["splits"]["train"]
    assert read_split(result.manifest_uri).count() == s["rows"] and s["path"] == str(tmp_path / "prepared" / result.version / "train")
    assert 0.8 < m["packing_efficiency"] <= 1.0
    assert m["tokenizer"]["pad_token_id"] == tok.pad_token_id and m["tokenizer"]["eos_token_id"] == tok.eos_token_id

    # MLflow: a data run tagged with the version, counts as metrics, the version as a dataset input.
    from mlflow.tracking import MlflowClient

    run = MlflowClient().get_run(m["mlflow_run_id"])
    assert run.data.tags["rayline.dataset_version"] == result.version
    assert run.data.tags["rayline.dataset_manifest"] == result.manifest_uri and run.data.tags["rayline.stage"] == "data"
    assert run.data.metrics["counts.read"] == n_lines and run.data.metrics["rejected.invalid_json"] == 1
    assert run.data.params["seq_len"] == "128"
    assert [d.dataset.name for d in run.inputs.dataset_inputs] == [f"rayline-{result.version}"]

    # Same inputs again: same version, nothing redone (a rebuild writing the same bytes is in test_shards).
    again = main(cfg)
    assert again.skipped and again.version == result.version and load_manifest(again.manifest_uri) == m


def test_s3_end_to_end(ray_session, s3_bucket, sample_corpus_dir, tiny_model_dir, tok):
    root = f"{s3_bucket}/data-tests/{uuid.uuid4().hex[:8]}"
    storage.copy_tree(str(sample_corpus_dir), f"{root}/corpus")
    storage.copy_tree(str(tiny_model_dir), f"{root}/tiny-model")
    cfg = config(inputs=[f"{root}/corpus/train.jsonl", f"{root}/corpus/malformed.jsonl"],
                 eval_inputs=[f"{root}/corpus/eval.jsonl"], output_uri=f"{root}/prepared", tokenizer=f"{root}/tiny-model")
    result = main(cfg)
    assert result.manifest_uri == f"{root}/prepared/{result.version}/manifest.json"
    assert result.counts["rejected_by_reason"] == MALFORMED_REASONS
    files = storage.list_files(f"{root}/prepared/{result.version}")
    assert "manifest.json" in files and any(f.startswith("train/") and f.endswith(".parquet") for f in files)
    assert {f.split("/")[0] for f in files} == {"eval", "manifest.json", "rejects", "train"}  # no shuffle files left
    assert any(f.startswith("rejects/") for f in files)
    m = load_manifest(f"{root}/prepared/{result.version}")
    assert m["splits"]["train"]["path"] == f"{root}/prepared/{result.version}/train"
    assert m["sources"] == cfg.inputs + cfg.eval_inputs
    assert sorted(decoded_segments(result.manifest_uri, "eval", tok)) == sorted(rendered([sample_corpus_dir / "eval.jsonl"], tok))
    assert read_split(result.manifest_uri, "train").count() == m["splits"]["train"]["rows"]
    assert main(cfg).skipped


def test_too_many_rejects_fail_the_run_through_the_entry_point(ray_session, local_stack, sample_corpus_dir,
                                                               tiny_model_dir, tmp_path, capsys):
    from pipelines import prepare_data

    good = tmp_path / "good.jsonl"
    good.write_text("".join((sample_corpus_dir / "train.jsonl").read_text().splitlines(keepends=True)[:30]))
    out = tmp_path / "prepared"
    code = prepare_data.main(["--config", SAMPLE_YAML, f"inputs=[{good},{sample_corpus_dir / 'malformed.jsonl'}]",
                              "eval_inputs=[]", f"output_uri={out}", f"tokenizer={tiny_model_dir}", "max_reject_fraction=0.1"])
    err = capsys.readouterr().err
    assert code == 1 and "10 of 40 records rejected (25.0%" in err and "max_reject_fraction is 10.0%" in err
    version = next(p for p in out.iterdir())
    assert not (version / "manifest.json").exists()  # not a usable version
    assert sum(len(p.read_text().splitlines()) for p in (version / "rejects").iterdir()) == 10
    assert "invalid_json 1" in err and str(version / "rejects") in err


@pytest.mark.parametrize("cpus, shards, node_free, want", [
    (16, 2, 16, 8),  # a few shards on a big node share its CPUs
    (2, 4, 2, 1),  # more shards than CPUs: one each
    (4, 2, 1.8, 1),  # 4 CPUs over a 2-CPU head (0.2 held by an app) and two 1-CPU nodes: no task can get 2
    (64, 1, 8, 8),  # one shard on a cluster of 8-CPU nodes: what one node has
    (2, 1, 0.0, 1),  # everything busy now: one, and it waits its turn
])
def test_shard_task_cpus_fit_on_one_node(cpus, shards, node_free, want):
    from data.prepare import _task_threads

    assert _task_threads(cpus, shards, node_free) == want


def test_the_read_phase_alone_runs_without_ray_datas_reservation(ray_session):
    """The read phase's dataset is made without the per-operator reservation (which holds a lone operator to one task
    at a time on 2 CPUs until its first task reports); datasets made before or after keep Ray Data's default."""
    from data.prepare import _no_reservation

    before = ray_session.data.range(4)
    with _no_reservation():
        reads = ray_session.data.range(4)
    after = ray_session.data.range(4)
    assert reads.context.op_resource_reservation_enabled is False
    assert before.context.op_resource_reservation_enabled is True and after.context.op_resource_reservation_enabled
    assert ray_session.data.DataContext.get_current().op_resource_reservation_enabled is True
    assert sorted(row["id"] for row in reads.take_all()) == [0, 1, 2, 3]  # it runs, as any dataset does


def test_shards_sized_by_input_keep_what_a_fixed_count_keeps(ray_session, local_stack, sample_corpus_dir,
                                                             tiny_model_dir, tmp_path):
    """`num_shards: 0` cuts the work by input bytes (here 1 MiB a shard): more shards than the fixed count, the same
    records kept, dropped and rejected (every copy of an example still meets its twins in one shard)."""
    train = (sample_corpus_dir / "train.jsonl").read_text()
    copies = []
    for i in range(1 + (3 << 20) // len(train.encode())):  # > 3 MiB: copies of the corpus, deduplicated away
        copies.append(tmp_path / f"copy-{i}.jsonl")
        copies[-1].write_text(train)
    inputs = [str(p) for p in copies] + [str(sample_corpus_dir / "malformed.jsonl")]
    size = sum(p.stat().st_size for p in copies) + (sample_corpus_dir / "malformed.jsonl").stat().st_size
    common = {"inputs": inputs, "eval_inputs": [str(sample_corpus_dir / "eval.jsonl")], "tokenizer": str(tiny_model_dir),
              "max_reject_fraction": 0.5}
    fixed = main(config(**common, output_uri=str(tmp_path / "fixed")))
    sized = main(config(**common, output_uri=str(tmp_path / "sized"), num_shards=0, shard_bytes=1 << 20))
    total = size + (sample_corpus_dir / "eval.jsonl").stat().st_size
    assert fixed.manifest["num_shards"] == 2 and sized.manifest["num_shards"] == -(-total // (1 << 20)) >= 4
    assert len(list((tmp_path / "sized" / sized.version / "train").glob("*.parquet"))) == sized.manifest["num_shards"]
    built = sized.manifest["built_with"]  # the shard tasks share the cluster's CPUs, one thread at least
    assert built["cluster_cpus"] >= 1 and \
        1 <= built["tokenizer_threads_per_shard"] <= max(1, built["cluster_cpus"] // sized.manifest["num_shards"])
    assert sized.counts == fixed.counts and sized.counts["deduplicated"] >= len(copies[1:]) * 600
    for split in ("train", "eval"):  # the same examples and tokens; only how they are packed into rows may differ
        assert [sized.splits[split][k] for k in ("examples", "tokens")] == \
            [fixed.splits[split][k] for k in ("examples", "tokens")], split
