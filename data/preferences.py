"""One preference record -> a validated (prompt, chosen, rejected) triple or a `Reject`; a triple -> a token row.

A record is a JSON object with
    prompt (a string) or messages (a list of {role, content} ending on a user turn), and
    chosen, rejected: the preferred and the dispreferred assistant answer (strings, different after cleaning).
Reason codes follow data/records.py (invalid_json, missing_field:<name>, wrong_type:<name>, empty_text, bad_role,
too_long_chars, ...) plus `same_answers` (chosen equals rejected), `ends_with_assistant` (the prompt's last turn is the
model's), and at tokenizing `too_long` and `template_error`.

A row holds, for each answer, the prompt + answer tokens (`chosen_input_ids`, right-padded to seq_len), their labels
(-100 on the prompt and the padding, so only the answer's tokens are scored, as the chat template's
`{% generation %}` block marks them) and the unpadded length.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from data.records import ROLES, Reject, _clean_field, _type_name, decode_utf8, parse_json_object
from data.packing import IGNORE as IGNORE_INDEX

ANSWERS = ("chosen", "rejected")
TOKEN_COLUMNS = tuple(f"{a}_{c}" for a in ANSWERS for c in ("input_ids", "labels"))
LENGTH_COLUMNS = tuple(f"{a}_length" for a in ANSWERS)
COLUMNS = (*TOKEN_COLUMNS, *LENGTH_COLUMNS)
ROW_SCHEMA = pa.schema([*((name, pa.list_(pa.int32())) for name in TOKEN_COLUMNS),
                        *((name, pa.int32()) for name in LENGTH_COLUMNS)])


@dataclass(frozen=True)
class Preference:
    prompt: tuple[tuple[str, str], ...]
    """(role, content) turns; the last is the user's."""
    chosen: str
    rejected: str

    def key(self) -> bytes:
        """What exact dedup compares: the normalised prompt and both answers."""
        turns = "\x1e".join(f"{r}\x1f{c}" for r, c in self.prompt)
        return f"{turns}\x1d{self.chosen}\x1d{self.rejected}".encode("utf-8")


@dataclass(frozen=True)
class PreferenceRules:
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    system_field: str = "system"
    unicode_form: str = "NFC"
    max_chars: int = 200_000


def _prompt(obj: dict, rules: PreferenceRules) -> tuple[tuple[str, str], ...] | Reject:
    if "messages" in obj:
        raw = obj["messages"]
        if not isinstance(raw, list) or not raw:
            return Reject("wrong_type:messages", f"messages is {_type_name(raw)}; expected a non-empty list of "
                          "{role, content} objects")
        turns = []
        for i, m in enumerate(raw):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                return Reject("wrong_type:message", f"messages[{i}] must be an object with role and content")
            if m["role"] not in ROLES:
                return Reject("bad_role", f"messages[{i}].role is {m['role']!r}; expected one of {', '.join(ROLES)}")
            content = _clean_field(m["content"], f"messages[{i}].content", rules)
            if isinstance(content, Reject):
                return content
            turns.append((m["role"], content))
        if turns[-1][0] == "assistant":
            return Reject("ends_with_assistant", "messages end with an assistant turn; the answers to compare go in "
                          f"{rules.chosen_field} and {rules.rejected_field}, not in messages")
        return tuple(turns)
    if rules.prompt_field not in obj:
        return Reject(f"missing_field:{rules.prompt_field}", f"no '{rules.prompt_field}' or 'messages' field "
                      f"(fields: {', '.join(sorted(obj)) or 'none'})")
    turns = []
    if obj.get(rules.system_field) is not None:
        system = _clean_field(obj[rules.system_field], rules.system_field, rules)
        if isinstance(system, Reject):
            return system
        turns.append(("system", system))
    prompt = _clean_field(obj[rules.prompt_field], rules.prompt_field, rules)
    if isinstance(prompt, Reject):
        return prompt
    return (*turns, ("user", prompt))


def parse_preference(raw: bytes, rules: PreferenceRules) -> Preference | Reject:
    """Validate and clean one JSONL record (see the module docstring); a Reject names the field at fault."""
    text = decode_utf8(raw)
    if isinstance(text, Reject):
        return text
    obj = parse_json_object(text)
    if isinstance(obj, Reject):
        return obj
    prompt = _prompt(obj, rules)
    if isinstance(prompt, Reject):
        return prompt
    answers = []
    for name in (rules.chosen_field, rules.rejected_field):
        if name not in obj:
            return Reject(f"missing_field:{name}", f"no '{name}' field (fields: {', '.join(sorted(obj))})")
        value = _clean_field(obj[name], name, rules)
        if isinstance(value, Reject):
            return value
        answers.append(value)
    chosen, rejected = answers
    if chosen == rejected:
        return Reject("same_answers", f"{rules.chosen_field} and {rules.rejected_field} are the same text after "
                      "cleaning; a pair must prefer one answer over another")
    chars = sum(len(c) for _, c in prompt) + len(chosen) + len(rejected)
    if chars > rules.max_chars:
        return Reject("too_long_chars", f"{chars} characters after cleaning; max_chars is {rules.max_chars}")
    return Preference(prompt, chosen, rejected)


def _answer_tokens(tok, prompt: list[dict], answer: str) -> tuple[list[int], list[int]] | Reject:
    """Prompt + answer through the chat template: (input ids, labels on the answer's generation tokens only)."""
    try:
        enc = tok.apply_chat_template([*prompt, {"role": "assistant", "content": answer}], tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True)
    except Exception as e:  # a template that fails on this record: the record is rejected, the run goes on
        return Reject("template_error", f"the chat template failed: {e}")
    ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
    if not any(mask):
        return Reject("template_error", "the chat template marks no assistant tokens ({% generation %})")
    return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]


def tokenize_preference(tok, pref: Preference, seq_len: int, pad_id: int) -> dict | Reject:
    """The row of one pair (module docstring); Reject too_long when either side exceeds seq_len tokens."""
    prompt = [{"role": r, "content": c} for r, c in pref.prompt]
    row: dict = {}
    for name, answer in (("chosen", pref.chosen), ("rejected", pref.rejected)):
        out = _answer_tokens(tok, prompt, answer)
        if isinstance(out, Reject):
            return out
        ids, labels = out
        if len(ids) > seq_len:
            return Reject("too_long", f"prompt + {name} is {len(ids)} tokens; seq_len is {seq_len}")
        pad = seq_len - len(ids)
        row[f"{name}_input_ids"] = ids + [pad_id] * pad
        row[f"{name}_labels"] = labels + [IGNORE_INDEX] * pad
        row[f"{name}_length"] = len(ids)
    return row
