"""The data stage end to end on corpora as users have them, on the real local Ray cluster: compressed files and many
small ones, a weighted mixture, and a corpus with planted near copies."""

import gzip
import json
from collections import Counter

import pytest

from data.prepared import load_manifest
from data.tokens import load_tokenizer, read_tokenizer_files
from core import storage
from tests.data.planted import NGRAM, THRESHOLD, planted_corpus
from tests.data.test_compressed import compress
from tests.data.test_prepare import MALFORMED_REASONS, config, decoded_segments, main, rendered


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(read_tokenizer_files(str(tiny_model_dir))[1])


def rejects_of(version_uri) -> list[dict]:
    folder = storage.join(version_uri, "rejects")
    return [json.loads(x) for f in storage.list_files(folder) for x in storage.read_text(storage.join(folder, f)).splitlines()]


def test_compressed_and_many_small_files_land_as_the_plain_files(ray_session, local_stack, sample_corpus_dir,
                                                                  tiny_model_dir, tok, tmp_path):
    """train.jsonl cut into 300 small gzip and zstd files under one folder, malformed.jsonl as .jsonl.zst, eval.jsonl as
    .jsonl.gz: the same examples, rejects with the same line numbers, as the plain files give."""
    train, malformed, evalf = (sample_corpus_dir / f"{n}.jsonl" for n in ("train", "malformed", "eval"))
    small = tmp_path / "small"
    small.mkdir()
    lines = train.read_bytes().splitlines(keepends=True)
    for i in range(300):
        compress(small / f"{i:04d}.jsonl.{'gz' if i % 2 else 'zst'}", b"".join(lines[i * 2:(i + 1) * 2]),
                 "gzip" if i % 2 else "zstd")
    assert sum(1 for _ in small.iterdir()) == 300 and len(lines) == 600
    compress(tmp_path / "malformed.jsonl.zst", malformed.read_bytes(), "zstd")
    (tmp_path / "eval.jsonl.gz").write_bytes(gzip.compress(evalf.read_bytes()))
    cfg = config(inputs=[str(small), str(tmp_path / "malformed.jsonl.zst")], eval_inputs=[str(tmp_path / "eval.jsonl.gz")],
                 output_uri=str(tmp_path / "prepared"), tokenizer=str(tiny_model_dir))
    result = main(cfg)
    c = result.counts
    assert c["read"] == 600 + 10 + len(evalf.read_bytes().splitlines()) and c["rejected_by_reason"] == MALFORMED_REASONS
    rejects = rejects_of(result.version_uri)
    assert sorted(r["line"] for r in rejects) == list(range(1, 11))  # the lines of the decompressed text
    assert {r["source"] for r in rejects} == {str(tmp_path / "malformed.jsonl.zst")}
    raw_lines = malformed.read_bytes().splitlines()
    assert all(r["raw"] in (raw_lines[r["line"] - 1].decode("utf-8", "replace"), repr(raw_lines[r["line"] - 1]))
               for r in rejects)
    assert Counter(decoded_segments(result.manifest_uri, "train", tok)) == Counter(rendered([train], tok))
    assert sorted(decoded_segments(result.manifest_uri, "eval", tok)) == sorted(rendered([evalf], tok))
    assert len(result.manifest["sources"]) == 302 and all(len(h) == 64 for h in result.manifest["source_hashes"].values())


def chat_file(path, name, n):
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{name} question {i}?"},
                                                     {"role": "assistant", "content": f"{name} answer {i}."}]}) + "\n"
                            for i in range(n)))


def test_a_mixture_takes_each_source_by_weight(ray_session, local_stack, tiny_model_dir, tok, tmp_path):
    """70% instructions / 20% code / 10% chat of 200 records from sources of 300, 25 and 8: instructions downsampled,
    code and chat repeated whole and then some; the manifest says so and the written examples agree."""
    sizes = {"instructions": 300, "code": 25, "chat": 8}
    for name, n in sizes.items():
        (tmp_path / name).mkdir()
        chat_file(tmp_path / name / "a.jsonl", name, n)
    mixture = [{"name": n, "inputs": [str(tmp_path / n)], "weight": w}
               for n, w in zip(sizes, (0.7, 0.2, 0.1))]
    cfg = config(inputs=[], mixture=mixture, mixture_records=200, eval_fraction=0.0,
                 output_uri=str(tmp_path / "prepared"), tokenizer=str(tiny_model_dir))
    result = main(cfg)
    rows = {r["name"]: r for r in result.manifest["mixture"]}
    assert {n: (r["weight"], r["records"], r["taken"]) for n, r in rows.items()} == {
        "instructions": (0.7, 300, 140), "code": (0.2, 25, 40), "chat": (0.1, 8, 20)}
    assert result.counts["read"] == 200 and result.counts["written_examples"] == 200 and result.counts["deduplicated"] == 0
    written = Counter(text.split("user\n", 1)[1].split(" ", 1)[0] for text in decoded_segments(result.manifest_uri, "train", tok))
    assert written == {"instructions": 140, "code": 40, "chat": 20}  # exactly the shares, none lost to exact dedup
    per_record = Counter(text for text in decoded_segments(result.manifest_uri, "train", tok) if "chat question" in text)
    assert sorted(per_record.values()) == [2] * 4 + [3] * 4  # 8 records, 20 taken: all twice, 4 a third time
    again = main(config(inputs=[], mixture=mixture, mixture_records=200, eval_fraction=0.0,
                        output_uri=str(tmp_path / "prepared"), tokenizer=str(tiny_model_dir)))
    assert again.skipped and again.version == result.version


def test_planted_near_copies_are_removed_naming_their_originals(ray_session, local_stack, tiny_model_dir, tmp_path):
    (tmp_path / "corpus").mkdir()
    planted = planted_corpus(tmp_path / "corpus")
    cfg = config(inputs=[str(tmp_path / "corpus")], format="text", near_dedup=True, near_dedup_threshold=THRESHOLD,
                 near_dedup_ngram=NGRAM, eval_fraction=0.0, output_uri=str(tmp_path / "prepared"),
                 tokenizer=str(tiny_model_dir))
    result = main(cfg)
    c = result.counts
    assert c["near_deduplicated"] == len(planted["near"]) and c["deduplicated"] == len(planted["exact"])
    assert c["rejected"] == 0 and c["written_examples"] == planted["documents"]
    near = {(r["source"], r["line"]): (r["near_copy_of"]["source"], r["near_copy_of"]["line"])
            for r in rejects_of(result.version_uri) if r["reason"] == "near_duplicate"}
    assert near == planted["near"]  # exactly the planted copies, each naming its original
    m = load_manifest(result.manifest_uri)
    assert m["near_dedup"]["bands"] * m["near_dedup"]["rows"] <= 128 and m["near_dedup"]["threshold"] == THRESHOLD
    # Deterministic: a rebuild removes the same records and names the same originals.
    rebuilt = main(config(**{**cfg.__dict__, "overwrite": True}))
    assert rebuilt.version == result.version and rebuilt.counts == c
    assert {(r["source"], r["line"]): r["near_copy_of"]["line"] for r in rejects_of(rebuilt.version_uri)} == \
        {k: v[1] for k, v in planted["near"].items()}
