import json

from transformers import AutoModelForCausalLM, AutoTokenizer

from pipelines.sample_corpus import make_records


def test_tiny_model_loads_and_generates(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    info = json.loads((tiny_model_dir / "rayline_model.json").read_text())
    assert info["params"] == sum(p.numel() for p in model.parameters()) < 1_000_000
    assert model.config.model_type == "llama"
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_chat_template_marks_only_assistant_tokens(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    msgs = make_records(1, seed=3, prefix="t")[0]["messages"]
    enc = tok.apply_chat_template(msgs, return_dict=True, return_assistant_tokens_mask=True)
    masked = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert tok.decode(masked) == msgs[-1]["content"] + tok.eos_token
    # Digits are single tokens so arithmetic answers are learnable.
    assert all(len(tok.tokenize(d)) == 1 for d in "0123456789")
