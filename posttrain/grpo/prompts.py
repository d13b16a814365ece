"""The prompt stream: chat records -> (prompt token ids, reference answer), read in a fixed order from a cursor, so
a resumed run reads exactly the prompts its checkpoint had not consumed."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    index: int
    """Position in the stream (what the cursor and the ledger count)."""
    record_id: str
    ids: list[int]
    reference: str
    text: str = ""
    """The rendered prompt (the chat template's text of `ids`): what a reward model reads before the completion."""


def load_prompts(uri: str, tokenizer, tasks: list[str] | None = None, limit: int = 0) -> list[Prompt]:
    """Chat JSONL at `uri` -> prompts: every message before the last (the assistant's reference answer) rendered with
    the chat template and the assistant's turn opened. A bad line raises naming the file and line."""
    from core import storage

    out: list[Prompt] = []
    for n, line in enumerate(storage.read_text(uri).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            messages = record["messages"]
            reference = messages[-1]["content"]
            if messages[-1]["role"] != "assistant":
                raise ValueError("the last message must be the assistant's reference answer")
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise ValueError(f"{uri}:{n}: not a chat record with a reference answer ({e}); expected "
                             '{"messages": [..., {"role": "assistant", "content": ANSWER}]}') from None
        if tasks and record.get("task") not in tasks:
            continue
        # Rendered once, then tokenized as apply_chat_template(tokenize=True) does (no special tokens added).
        text = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        out.append(Prompt(len(out), str(record.get("id", n)), ids, reference, text))
        if limit and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{uri}: no prompts" + (f" of tasks {tasks}" if tasks else ""))
    return out


def file_digest(uri: str) -> str:
    """sha256 of the prompt file (its version when the config names none)."""
    from core import storage

    return "sha256:" + hashlib.sha256(storage.read_bytes(uri)).hexdigest()[:16]


def take(prompts: list[Prompt], cursor: int, n: int) -> list[Prompt]:
    """The `n` prompts from stream position `cursor` (the stream wraps into the next pass over the file);
    each carries its stream position, so a prompt read in a second pass is a new consumption."""
    return [Prompt(cursor + i, p.record_id, p.ids, p.reference, p.text)
            for i, p in ((i, prompts[(cursor + i) % len(prompts)]) for i in range(n))]
