"""Tiny model kit: a locally trained tokenizer and a random-init Llama-architecture causal LM.

`python -m stack.tiny_model --out DIR --size tiny|small` writes a Hugging Face checkpoint
(config.json, model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json with a
chat template) that transformers and vLLM load like any hub model. Nothing is downloaded: the
byte-level BPE tokenizer is trained here on the sample corpus plus generic text.
`tiny` (<1M parameters) is for tests, `small` (tens of millions) for benchmarks.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from stack.sample_corpus import WORDS, corpus_text

PAD, EOS, IM_START = "<|pad|>", "<|im_end|>", "<|im_start|>"
SPECIAL_TOKENS = [PAD, IM_START, EOS]

# ChatML. `{% generation %}` marks assistant tokens so transformers can return the loss mask directly.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class ModelSize:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int


SIZES = {
    "tiny": ModelSize(512, 128, 352, 4, 4, 2, 512),
    "small": ModelSize(8192, 512, 1408, 8, 8, 4, 2048),
}


def train_tokenizer(vocab_size: int):
    """Byte-level BPE (digits split one per token, as Llama does) trained on local text only."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    generic = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    generic += ["The quick brown fox jumps over the lazy dog.", "system user assistant"]
    tok.train_from_iterator(corpus_text(seed=1234, n=3000) + generic * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=None,
        additional_special_tokens=[IM_START], model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write tokenizer + random-init LlamaForCausalLM for `size` to `out`; returns the directory."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if size not in SIZES:
        raise ValueError(f"size {size!r}: expected one of {sorted(SIZES)}")
    spec = SIZES[size]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec.vocab_size)
    tokenizer.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids(IM_START), torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=config.bos_token_id, do_sample=False, max_new_tokens=32,
    )
    model.save_pretrained(out, safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())
    (out / "rayline_model.json").write_text(json.dumps({"size": size, "params": n_params, "seed": seed}))
    return out


def build_reward_model(base_dir: str | Path, out: str | Path, seed: int = 0, std: float = 0.5) -> Path:
    """A reward model from the causal LM at `base_dir`: the same body with a one-label classification head
    (`LlamaForSequenceClassification`, `num_labels: 1`), the head random (normal, `std`, from `seed`), written with
    the base's tokenizer to `out`. Untrained: for tests and benchmarks of the reward-model path (its scores are what
    transformers computes, not a judgement of the answers)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    config = AutoConfig.from_pretrained(base_dir)
    config.num_labels, config.architectures = 1, ["LlamaForSequenceClassification"]
    model = LlamaForSequenceClassification.from_pretrained(base_dir, config=config)
    torch.manual_seed(seed)
    with torch.no_grad():
        torch.nn.init.normal_(model.score.weight, std=std)
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
    return out


def build_adapter(base_dir: str | Path, out: str | Path, seed: int | None = None, rank: int = 4,
                  targets: tuple[str, ...] = ("q_proj", "v_proj")) -> Path:
    """A PEFT LoRA adapter of the model at `base_dir`, written by peft to `out`: peft's own initialisation (lora_B
    zero: it changes nothing) when `seed` is None, else random lora_A and lora_B (normal, std 0.5) from `seed`,
    large enough to change the answers. For tests and benchmarks of the LoRA path (no training needed)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed or 0)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), task_type="CAUSAL_LM",
                        init_lora_weights=seed is None)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config)
    if seed is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_(0, 0.5)
    model.save_pretrained(out)
    return Path(out)


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = build_tiny_model(args.out, args.size, args.seed)
    info = json.loads((out / "rayline_model.json").read_text())
    print(f"wrote {args.size} model ({info['params']:,} parameters) to {out}")
    return out


if __name__ == "__main__":
    main()
