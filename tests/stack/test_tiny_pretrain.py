"""The demo base's pretraining (stack/tiny_pretrain.py): plain text without the eval questions, a loss that
falls, a checkpoint transformers loads with what it was trained on recorded beside it."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from stack.sample_corpus import make_records, plain_text
from stack.tiny_pretrain import main, pretrain, questions_of


def test_plain_text_is_question_and_answer_without_the_left_out_questions():
    left_out = {r["messages"][-2]["content"] for r in make_records(20, 1, "eval")}
    texts = plain_text(200, 2, exclude=left_out)
    assert len(texts) == 200 and not any("<|im_start|>" in t for t in texts)
    assert not {t for t in texts for q in left_out if t.startswith(q + " ")}
    sums = [t.removeprefix("What is ").split("? ") for t in texts if t.startswith("What is ")]
    assert sums and all(int(answer) == sum(map(int, q.split(" + "))) for q, answer in sums)  # each fact is right


def test_pretraining_lowers_the_loss_and_writes_a_loadable_model(tiny_model_dir, tmp_path):
    facts = pretrain(tiny_model_dir, tmp_path, plain_text(2000, 2), steps=40, lr=2e-3)
    assert facts["steps"] == 40 and facts["loss_last"] < facts["loss_first"] - 1.0, facts
    info = json.loads((tmp_path / "rayline_model.json").read_text())
    assert info["pretrained"] == facts and info["size"] == "tiny"  # the kit's own facts stay
    before, after = (AutoModelForCausalLM.from_pretrained(d) for d in (tiny_model_dir, tmp_path))
    assert not torch.equal(before.model.embed_tokens.weight, after.model.embed_tokens.weight)


def test_the_cli_pretrains_without_the_questions_of_a_chat_file(tiny_model_dir, sample_corpus_dir, tmp_path):
    """What the demo runs beside its data stage: `python -m stack.tiny_pretrain ... --leave-out eval.jsonl`."""
    eval_file = sample_corpus_dir / "eval.jsonl"
    left_out = questions_of(eval_file)
    assert left_out == {r["messages"][-2]["content"] for r in map(json.loads, eval_file.read_text().splitlines())}
    assert len(left_out) > 50
    facts = main(["--model", str(tiny_model_dir), "--out", str(tmp_path), "--steps", "2", "--records", "300",
                  "--leave-out", str(eval_file)])
    assert facts["steps"] == 2 and facts["texts"] == 300, facts
    assert json.loads((tmp_path / "rayline_model.json").read_text())["pretrained"] == facts


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": 0}, "steps >= 1"),
    ({"texts": []}, "some text"),
    ({"texts": ["a"], "seq_len": 128}, "fewer than a batch"),
])
def test_bad_pretraining_settings_are_refused(tiny_model_dir, tmp_path, kwargs, message):
    args = {"texts": plain_text(50, 2), **kwargs}
    with pytest.raises(ValueError, match=message):
        pretrain(tiny_model_dir, tmp_path, **args)
