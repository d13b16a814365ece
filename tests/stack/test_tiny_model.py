"""The tiny model kit: architecture and size as specified, a deterministic build, a model that learns."""

import json
import math
from dataclasses import astuple

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from stack.sample_corpus import make_records
from stack.tiny_model import SIZES, build_tiny_model


def tiny_params(spec, vocab: int) -> int:
    """Parameters of a tied-embedding Llama of `spec` over `vocab` tokens, counted from the architecture."""
    head_dim = spec.hidden_size // spec.num_attention_heads
    attention = 2 * spec.hidden_size * spec.hidden_size + 2 * spec.hidden_size * spec.num_key_value_heads * head_dim
    layer = attention + 3 * spec.hidden_size * spec.intermediate_size + 2 * spec.hidden_size
    return vocab * spec.hidden_size + spec.num_hidden_layers * layer + spec.hidden_size


def test_tiny_model_has_the_tiny_architecture(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    spec = SIZES["tiny"]
    c = model.config
    assert (c.model_type, c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.tie_word_embeddings) == ("llama", *astuple(spec)[1:6], True)
    # The BPE trainer stops short of its 512-token budget when the corpus has no more merges to make.
    assert c.vocab_size == len(tok) == 469 and len(tok) <= spec.vocab_size
    assert (tok.pad_token, tok.eos_token) == ("<|pad|>", "<|im_end|>")
    info = json.loads((tiny_model_dir / "rayline_model.json").read_text())
    n = sum(p.numel() for p in model.parameters())
    assert info == {"size": "tiny", "params": n, "seed": 0} and n == tiny_params(spec, len(tok)) == 798_464


def test_build_is_deterministic_per_seed(tiny_model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again", "tiny", seed=0)
    other = build_tiny_model(tmp_path / "other", "tiny", seed=1)
    assert (again / "tokenizer.json").read_text() == (tiny_model_dir / "tokenizer.json").read_text()
    first, second, third = (load_file(d / "model.safetensors") for d in (tiny_model_dir, again, other))
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], third["model.embed_tokens.weight"])


def test_a_few_steps_on_the_corpus_lower_the_loss(tiny_model_dir):
    """The random-init model learns from the chat-templated corpus: 30 Adam steps on 16 records cut the loss."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    enc = tok.apply_chat_template([r["messages"] for r in make_records(16, seed=5, prefix="t")], return_dict=True,
                                  return_assistant_tokens_mask=True, padding=True, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["assistant_masks"] == 0, -100)

    def loss() -> torch.Tensor:
        return model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=labels).loss

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    before = float(loss().detach())
    assert before == pytest.approx(math.log(len(tok)), rel=0.1)  # random init: about uniform over the vocabulary
    for _ in range(30):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    assert float(loss().detach()) < before - 2.0


def test_chat_template_marks_only_assistant_tokens(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    msgs = make_records(1, seed=3, prefix="t")[0]["messages"]
    enc = tok.apply_chat_template(msgs, return_dict=True, return_assistant_tokens_mask=True)
    masked = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert tok.decode(masked) == msgs[-1]["content"] + tok.eos_token
    # Digits are single tokens so arithmetic answers are learnable.
    assert all(len(tok.tokenize(d)) == 1 for d in "0123456789")
