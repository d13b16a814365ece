"""Batch stage row rules (serve/batch/rows.py, metrics.py): sampling checks, chat messages, the validator that
turns raw rows into engine requests or refusals, finish reasons and eval metrics. No engine."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from serve.batch import metrics, rows

@pytest.mark.parametrize("params, problem", [
    ({"max_tokens": 8}, None),
    ({"max_tokens": -3}, "sampling_params.max_tokens: must be an integer >= 1, got -3"),
    ({"temperature": -0.5}, "sampling_params.temperature: must be a number >= 0"),
    ({"top_p": 0}, "sampling_params.top_p"),
    ({"max_tokens": True}, "sampling_params.max_tokens"),
    ({"beam_width": 2}, "sampling_params.beam_width: unknown parameter"),
    ({"max_tokens": 4, "min_tokens": 5}, "sampling_params.min_tokens: 5 is more than max_tokens 4"),
])
def test_sampling_problem(params, problem):
    found = rows.sampling_problem(params)
    assert found is None if problem is None else found.startswith(problem)


def test_trailing_assistant_message_is_the_reference():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    prompt, reference, problem = rows.split_messages(msgs)
    assert (prompt, reference, problem) == (msgs[:2], "a", None)
    assert rows.split_messages([{"role": "robot", "content": "x"}])[2].startswith("invalid_record: messages[0].role")
    assert rows.split_messages([{"role": "system", "content": "x"}])[2].startswith("missing_prompt")


def test_finish_reason_and_metrics():
    assert rows.finish_reason(16, 10, 16, 256) == "length"
    assert rows.finish_reason(3, 10, 16, 256) == "stop"
    assert rows.finish_reason(6, 250, 16, 256) == "length"
    assert metrics.exact_match("  Odd \n", "odd") and not metrics.exact_match("odd.", "odd")
    assert metrics.contains("the answer is 42 ok", "42") and not metrics.contains("420", "42")
    table = pa.table({
        "output": ["odd", "12", None, "x"], "reference": ["odd", "13", "4", None], "task": ["p", "s", "s", "p"],
    })
    scores = metrics.score(table, ["exact_match"])
    assert scores == {"scored_rows": 3.0, "exact_match": 1 / 3, "exact_match.p": 1.0, "exact_match.s": 0.0}


def test_validator_turns_rows_into_requests_or_reasons(tiny_model_dir):
    v = rows.PromptValidator(str(tiny_model_dir), 64, {"max_tokens": 8, "temperature": 0.0}, jsonl=True)
    ok = v.request({"text": json.dumps({"id": "a", "messages": [{"role": "user", "content": "What is 1 + 1?"},
                                                                 {"role": "assistant", "content": "2"}],
                                        "sampling_params": {"max_tokens": 3}})})
    assert ok[rows.ERROR_COLUMN] == "" and ok["reference"] == "2" and ok["sampling_params"]["max_tokens"] == 3
    assert ok["prompt"].endswith("assistant\n") and ok["prompt_tokens"] == len(ok["tokenized_prompt"]) > 0
    long = v.request({"text": json.dumps({"id": "b", "prompt": "apple " * 100})})
    assert long[rows.ERROR_COLUMN].startswith("prompt_too_long: ") and long["tokenized_prompt"] == []
    assert v.request({"text": "[1, 2]"})[rows.ERROR_COLUMN].startswith("invalid_record: expected a JSON object")
    assert v.request({"text": json.dumps({"id": "c", "prompt": " "})})[rows.ERROR_COLUMN].startswith("missing_prompt")
    # The reader's source travels with the row; a line that is not UTF-8 (text null) is refused, not a crash.
    assert ok["source"] is None and v.request({"source": "p.jsonl:3", "text": "{}"})["source"] == "p.jsonl:3"
    undecodable = v.request({"source": "p.jsonl:4", "text": None})
    assert undecodable[rows.ERROR_COLUMN] == "invalid_record: the line is not UTF-8 text"
    assert undecodable["source"] == "p.jsonl:4" and undecodable["id"].startswith("sha1:")


@pytest.mark.slow  # Ray Data on the test stack's Ray
def test_validator_takes_parquet_rows_as_ray_data_hands_them_to_the_engine_stage(ray_session, tiny_model_dir, tmp_path):
    """Parquet rows reach the engine stage wrapped by ray.data.llm's preprocess, nested values as numpy
    arrays: the validator sees the same requests as from JSON."""
    import pyarrow.parquet as pq
    from ray.llm._internal.batch.stages.base import wrap_preprocess

    from core.config import from_dict
    from serve.batch.config import Config
    from serve.batch.inputs import read_inputs  # the batch stage's reader

    records = [
        {"id": "chat", "messages": [{"role": "user", "content": "Is 3 even or odd?"},
                                    {"role": "assistant", "content": "odd"}],
         "prompt": None, "sampling_params": {"max_tokens": 3, "temperature": None}},
        {"id": "plain", "messages": None, "prompt": "What is 2 + 2?", "sampling_params": None},
        {"id": "bad", "messages": None, "prompt": "hi", "sampling_params": {"max_tokens": -1, "temperature": None}},
        {"id": "none", "messages": [], "prompt": None, "sampling_params": None},
    ]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "p.parquet")
    defaults = {"max_tokens": 8, "temperature": 0.0}
    v = rows.PromptValidator(str(tiny_model_dir), 64, defaults, jsonl=False)

    def as_engine_stage(batch):
        return {"request": [json.dumps(r) for r in v.requests(batch["__data"])]}

    cfg = from_dict(Config, {"input_uri": str(tmp_path / "p.parquet"), "output_uri": str(tmp_path / "out"),
                             "engine": {"model": str(tiny_model_dir)}})
    ds = read_inputs(cfg, "parquet").map(wrap_preprocess(lambda r: {}, "__data"))
    got = {r["id"]: r for r in (json.loads(x["request"]) for x in ds.map_batches(as_engine_stage).take_all())}
    want = {r["id"]: v.request({**json.loads(json.dumps(r)), "source": f"p.parquet#{i}"}) for i, r in enumerate(records)}
    assert got == want
    assert got["chat"]["reference"] == "odd" and got["chat"]["sampling_params"]["max_tokens"] == 3
    assert got["chat"]["tokenized_prompt"] and got["plain"]["sampling_params"] == {**defaults}
    assert got["bad"][rows.ERROR_COLUMN].startswith("invalid_sampling_params: sampling_params.max_tokens")
    assert got["none"][rows.ERROR_COLUMN].startswith("missing_prompt")
