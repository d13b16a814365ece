"""Tokenizing with the chat template: ids and label masks equal transformers' own, decoded text matches."""

import numpy as np
import pytest

from data.examples import render
from data.template import ChatRenderer, TemplateSpec
from data.records import Reject
from data.tokens import (
    IGNORE,
    byte_lengths,
    check_template,
    encode_with_labels,
    load_backend,
    load_tokenizer,
    read_tokenizer_files,
    tokenizer_identity,
)
from stack.sample_corpus import make_records


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    _, files = read_tokenizer_files(str(tiny_model_dir))
    return load_tokenizer(files)


@pytest.fixture(scope="module")
def spec(tok):
    return ChatRenderer.build(TemplateSpec(tok.chat_template, dict(tok.special_tokens_map), tok.eos_token))


def conversations():
    convs = [[(m["role"], m["content"]) for m in r["messages"]] for r in make_records(60, 3, "t")]
    convs.append([("user", "hi"), ("assistant", "")])  # an empty assistant turn: only its end token is a label
    convs.append([("system", "Terse."), ("user", "a"), ("assistant", "b c"), ("user", "more 12?"), ("assistant", "yes")])
    convs.append([("user", "Grüße, naïve ☃?"), ("assistant", "Ça va ✓ 日本")])  # multi-byte characters
    return convs


@pytest.mark.parametrize("labels_from", ["offsets", "byte lengths", "wrong byte lengths"])
def test_ids_and_masks_equal_apply_chat_template(tok, spec, labels_from):
    convs = conversations()
    texts, spans = zip(*(render(c, spec) for c in convs))
    # The workers' tokenizer: the backend rebuilt from JSON, without transformers around it.
    backend = load_backend(tok.backend_tokenizer.to_str())
    token_bytes = byte_lengths(backend)
    assert token_bytes is not None  # the tiny model's tokenizer is byte-level BPE
    if labels_from == "wrong byte lengths":
        token_bytes = token_bytes + 1  # tokens that do not spell the text: found, and offsets used instead
    ids, labels, lengths = encode_with_labels(backend, list(texts), list(spans),
                                              None if labels_from == "offsets" else token_bytes)
    start = 0
    for conv, n in zip(convs, lengths.tolist()):
        ref = tok.apply_chat_template([{"role": r, "content": c} for r, c in conv], tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True)
        assert ids[start:start + n].tolist() == ref["input_ids"]
        assert (labels[start:start + n] != IGNORE).astype(int).tolist() == ref["assistant_masks"]
        start += n
    assert start == len(ids) == len(labels)


def test_labels_decode_to_assistant_turns_only(tok, spec):
    conv = [("system", "Terse."), ("user", "What is 2 + 3?"), ("assistant", "5"), ("user", "And 4 + 4?"), ("assistant", "8")]
    text, spans = render(conv, spec)
    ids, labels, _ = encode_with_labels(tok.backend_tokenizer, [text], [spans])
    assert tok.decode(ids) == text
    assert tok.decode(labels[labels != IGNORE]) == "5<|im_end|>8<|im_end|>"
    prompt = tok.decode(ids[labels == IGNORE])
    assert "Terse." in prompt and "What is 2 + 3?" in prompt and "5" not in prompt.replace("2 + 3", "")


def test_raw_text_labels_every_token(tok):
    spec = ChatRenderer.build(TemplateSpec(None, {}, tok.eos_token))
    text, spans = render("plain words for pre-training", spec)
    assert text.endswith(tok.eos_token) and spans == [0, len(text)]
    ids, labels, lengths = encode_with_labels(tok.backend_tokenizer, [text], None)
    assert np.array_equal(ids, labels) and lengths.tolist() == [len(ids)]


def test_template_errors_become_rejects():
    spec = ChatRenderer.build(TemplateSpec("{{ raise_exception('roles must alternate') }}", {}, ""))
    result = render([("user", "a"), ("assistant", "b")], spec)
    assert isinstance(result, Reject) and result.reason == "template_error" and "alternate" in result.detail


def test_template_without_generation_block_is_refused():
    with pytest.raises(ValueError, match="generation"):
        check_template("{% for m in messages %}{{ m.content }}{% endfor %}", "tokenizer x")
    with pytest.raises(ValueError, match="no chat template"):
        check_template(None, "tokenizer x")


def test_identity_changes_with_the_files(tok, tiny_model_dir):
    _, files = read_tokenizer_files(str(tiny_model_dir))
    a = tokenizer_identity("x", files, tok)
    b = tokenizer_identity("x", {**files, "tokenizer.json": files["tokenizer.json"] + b" "}, tok)
    assert a["hash"] != b["hash"] and a["pad_token_id"] == tok.pad_token_id and a["vocab_size"] == len(tok)
    assert "config.json" not in files and "model.safetensors" not in files


def test_missing_tokenizer_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        read_tokenizer_files(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_tokenizer_files(str(tmp_path / "nope" / "deeper"))


def test_byte_lengths_only_for_byte_level_bpe():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    assert byte_lengths(wordpiece) is None
    lowercased = Tokenizer(models.BPE({"a": 0}, []))
    lowercased.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    lowercased.normalizer = normalizers.Lowercase()
    assert byte_lengths(lowercased) is None
