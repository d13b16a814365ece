"""Preference records and versions: validation with reasons, dedup, rejects kept, the manifest and its version."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from data.manifest import RejectFractionError
from data.preference_config import PreferenceConfig
from data.preference_prepare import prepare_preferences
from data.preferences import PreferenceRules, parse_preference
from data.records import Reject

RULES = PreferenceRules()


def _parse(obj) -> object:
    return parse_preference(json.dumps(obj).encode() if not isinstance(obj, bytes) else obj, RULES)


@pytest.mark.parametrize("record, reason, detail", [
    (b"{not json", "invalid_json", "column"),
    (b"[1, 2]", "not_an_object", "a list"),
    ({"chosen": "a", "rejected": "b"}, "missing_field:prompt", "'prompt' or 'messages'"),
    ({"prompt": "q", "chosen": "a"}, "missing_field:rejected", "'rejected'"),
    ({"prompt": "q", "chosen": 7, "rejected": "b"}, "wrong_type:chosen", "an integer"),
    ({"prompt": "q", "chosen": "  ", "rejected": "b"}, "empty_text", "chosen"),
    ({"prompt": "q", "chosen": "same", "rejected": " same "}, "same_answers", "same text"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "chosen": "a",
      "rejected": "b"}, "ends_with_assistant", "assistant turn"),
    ({"messages": [{"role": "bot", "content": "q"}], "chosen": "a", "rejected": "b"}, "bad_role", "messages[0].role"),
    ({"messages": "q", "chosen": "a", "rejected": "b"}, "wrong_type:messages", "a string"),
])
def test_a_bad_record_is_rejected_naming_the_field(record, reason, detail):
    got = _parse(record)
    assert isinstance(got, Reject) and got.reason == reason and detail in got.detail


def test_prompt_and_messages_forms_give_the_same_pair():
    a = _parse({"prompt": "What is 3 + 4?", "system": "Be brief.", "chosen": "7", "rejected": "8"})
    b = _parse({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 + 4?"}],
                "chosen": "7", "rejected": "8"})
    assert a == b and a.prompt[-1] == ("user", "What is 3 + 4?") and (a.chosen, a.rejected) == ("7", "8")


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


GOOD = [{"prompt": f"What is {i} + 1?", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(20)]


def test_a_version_dedups_keeps_rejects_with_their_line_and_writes_a_manifest(tmp_path, tiny_model_dir):
    inputs = _write(tmp_path / "p.jsonl", [*GOOD, GOOD[3], "{bad", {"prompt": "q", "chosen": "x", "rejected": "x"}])
    cfg = PreferenceConfig(output_uri=str(tmp_path / "out"), inputs=[inputs], tokenizer=str(tiny_model_dir),
                           seq_len=64, eval_fraction=0.25, max_reject_fraction=0.2, lineage={"batch_run": "r1"})
    result = prepare_preferences(cfg)
    c = result.counts
    assert (c["read"], c["deduplicated"], c["rejected"], c["written_examples"]) == (23, 1, 2, 20)
    assert c["rejected_by_reason"] == {"invalid_json": 1, "same_answers": 1}
    rejects = [json.loads(line) for line in (tmp_path / "out" / result.version / "rejects" / "rejects.jsonl")
               .read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rejects] == [(22, "invalid_json"), (23, "same_answers")]
    m = result.manifest
    assert m["format"] == "preference" and m["lineage"] == {"batch_run": "r1"} and m["seq_len"] == 64
    assert m["splits"]["train"]["rows"] + m["splits"]["eval"]["rows"] == 20 and m["splits"]["eval"]["rows"] > 0
    table = pq.read_table(m["splits"]["train"]["path"])
    assert table.column_names == m["columns"] and table.num_rows == m["splits"]["train"]["rows"]
    row = table.slice(0, 1).to_pylist()[0]
    assert len(row["chosen_input_ids"]) == 64 and row["chosen_length"] < 64
    # The labels are the answer's tokens only: the rejected side differs from the chosen side there and only there.
    scored = [i for i, t in enumerate(row["chosen_labels"]) if t != -100]
    assert scored and all(row["chosen_input_ids"][i] == row["chosen_labels"][i] for i in scored)

    again = prepare_preferences(cfg)
    assert again.skipped and again.version == result.version
    other = prepare_preferences(PreferenceConfig(**{**vars(cfg), "lineage": {"batch_run": "r2"}}))
    assert other.version != result.version  # lineage is part of what the version is


def test_too_many_rejects_fail_naming_the_reasons_and_where_they_are(tmp_path, tiny_model_dir):
    inputs = _write(tmp_path / "p.jsonl", [*GOOD[:4], "{bad", "{bad"])
    cfg = PreferenceConfig(output_uri=str(tmp_path / "out"), inputs=[inputs], tokenizer=str(tiny_model_dir))
    with pytest.raises(RejectFractionError, match=r"2 of 6 records rejected .*invalid_json 2.*rejects"):
        prepare_preferences(cfg)


def test_a_pair_longer_than_seq_len_is_rejected_as_too_long(tmp_path, tiny_model_dir):
    long = {"prompt": "word " * 40, "chosen": "a", "rejected": "b"}
    inputs = _write(tmp_path / "p.jsonl", [*GOOD, long])
    cfg = PreferenceConfig(output_uri=str(tmp_path / "out"), inputs=[inputs], tokenizer=str(tiny_model_dir),
                           seq_len=32, max_reject_fraction=0.1)
    assert prepare_preferences(cfg).counts["rejected_by_reason"] == {"too_long": 1}
