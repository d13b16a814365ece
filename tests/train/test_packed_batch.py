"""Packed rows: the block-diagonal causal mask keeps documents apart, and the loss sums only labelled tokens."""

import torch

from train.packed_batch import IGNORE_INDEX, block_causal_mask, forward_loss_sum, loss_tokens, model_inputs


def tiny_llama(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, attn_implementation=attn)
    return LlamaForCausalLM(cfg).eval()


def test_mask_is_block_diagonal_causal():
    mask = block_causal_mask(torch.tensor([[1, 1, 2, 2, 0]]), torch.float32)[0, 0]
    allowed = (mask == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]]


def test_packed_forward_equals_separate_documents():
    a, b = torch.randint(3, 64, (1, 7)), torch.randint(3, 64, (1, 5))
    batch = {
        "input_ids": torch.cat([a, b, torch.zeros(1, 4, dtype=torch.long)], 1),
        "position_ids": torch.cat([torch.arange(7), torch.arange(5), torch.zeros(4, dtype=torch.long)])[None],
        "segment_ids": torch.tensor([[1] * 7 + [2] * 5 + [0] * 4]),
    }
    for attn in ("sdpa", "eager"):
        model = tiny_llama(attn)
        with torch.no_grad():
            packed = model(**model_inputs(batch, torch.device("cpu"), torch.float32)).logits
            assert torch.allclose(packed[0, :7], model(input_ids=a).logits[0], atol=1e-5)
            assert torch.allclose(packed[0, 7:12], model(input_ids=b).logits[0], atol=1e-5)
            assert not torch.isnan(packed).any()


def test_loss_sums_labelled_tokens_after_the_shift():
    ids = torch.randint(3, 64, (2, 8))
    labels = torch.full((2, 8), IGNORE_INDEX)
    labels[0, 5:8] = ids[0, 5:8]
    labels[1, 0] = ids[1, 0]  # position 0 is never predicted: no loss token
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(8).repeat(2, 1),
             "segment_ids": torch.ones(2, 8, dtype=torch.long)}
    assert loss_tokens(batch) == 3
    model = tiny_llama("sdpa")
    with torch.no_grad():
        total = forward_loss_sum(model, batch, torch.device("cpu"), torch.float32)
        logits = model(input_ids=ids[:1]).logits[0]
        expected = torch.nn.functional.cross_entropy(logits[4:7], ids[0, 5:8], reduction="sum")
    assert torch.allclose(total, expected, atol=1e-5)
