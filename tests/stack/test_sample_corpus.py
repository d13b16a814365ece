import json

from stack.sample_corpus import TASKS, write_corpus


def test_corpus_is_deterministic_and_splits_disjoint(tmp_path):
    a = write_corpus(tmp_path / "a", seed=7, n_train=300, n_eval=50)
    b = write_corpus(tmp_path / "b", seed=7, n_train=300, n_eval=50)
    c = write_corpus(tmp_path / "c", seed=8, n_train=300, n_eval=50)
    assert a["train"].read_bytes() == b["train"].read_bytes()
    assert a["train"].read_bytes() != c["train"].read_bytes()
    train = [json.loads(line) for line in a["train"].read_text().splitlines()]
    evals = [json.loads(line) for line in a["eval"].read_text().splitlines()]
    assert len(train) == 300 and len(evals) == 50
    assert {r["task"] for r in train} == set(TASKS)
    q = lambda r: r["messages"][-2]["content"]  # noqa: E731
    assert not {q(r) for r in train} & {q(r) for r in evals}


def test_answers_are_checkable(tmp_path):
    paths = write_corpus(tmp_path, seed=1, n_train=50, n_eval=10)
    for line in paths["train"].read_text().splitlines():
        r = json.loads(line)
        question, answer = r["messages"][-2]["content"], r["messages"][-1]["content"]
        if r["task"] == "sum":
            a, b = question.removeprefix("What is ").removesuffix("?").split(" + ")
            assert int(answer) == int(a) + int(b)
        if r["task"] == "parity":
            n = int(question.split()[1])
            assert answer == ("even" if n % 2 == 0 else "odd")


def test_malformed_file_has_every_kind_of_bad_record(tmp_path):
    lines = write_corpus(tmp_path, n_train=5, n_eval=5)["malformed"].read_bytes().splitlines()
    assert len(lines) >= 8
    broken_json = 0
    for raw in lines:
        try:
            json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            broken_json += 1
    assert broken_json == 2  # truncated JSON and invalid UTF-8; the rest parse but are invalid records


def test_the_demo_question_is_taught_not_evaluated(tmp_path):
    """The demo's chat question (pipelines/demo.py QUESTION) is in its corpus's training split with its answer,
    and not in the eval split, so exact match on eval and the chat answer measure different things."""
    from pipelines.demo import QUESTION, DemoConfig

    cfg = DemoConfig()
    paths = write_corpus(tmp_path, seed=cfg.seed, n_train=cfg.n_train, n_eval=cfg.n_eval)
    pairs = {split: {(r["messages"][-2]["content"], r["messages"][-1]["content"])
                     for r in map(json.loads, paths[split].read_text().splitlines())} for split in ("train", "eval")}
    assert QUESTION in pairs["train"] and QUESTION[0] not in {q for q, _ in pairs["eval"]}
