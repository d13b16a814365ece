"""FSDP2 sharding units (train/fsdp.py): a decoder layer at a time or the whole model; the same training either way."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from core.config import ConfigError
from train.config import ModelConfig
from train.fsdp import build_sharded_model, decoder_layers


def two_steps(model_dir, unit: str) -> tuple[torch.nn.Module, list[float]]:
    torch.manual_seed(0)
    model = build_sharded_model(str(model_dir), torch.device("cpu"), fsdp_unit=unit)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(3, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return model, losses


def test_a_model_unit_trains_as_per_layer_units_do_with_one_unit(one_process_group, tiny_model_dir):
    per_layer, layer_losses = two_steps(tiny_model_dir, "layer")
    whole, model_losses = two_steps(tiny_model_dir, "model")
    units = lambda m: [n for n, mod in m.named_modules() if isinstance(mod, FSDPModule)]  # noqa: E731
    assert units(whole) == [""]  # the root alone
    assert len(units(per_layer)) == len(decoder_layers(per_layer)) + 1
    assert model_losses == pytest.approx(layer_losses, rel=1e-5) and model_losses[1] < model_losses[0]
    after = {k: v.full_tensor() for k, v in whole.state_dict().items()}
    for key, value in per_layer.state_dict().items():  # same parameter names, the same values after two steps
        assert torch.allclose(value.full_tensor(), after[key], atol=1e-5), key


def test_an_unknown_unit_is_named():
    with pytest.raises(ConfigError, match="model.fsdp_unit"):
        ModelConfig(path="m", fsdp_unit="block")
