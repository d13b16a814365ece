"""One input record -> validated, cleaned content, or a `Reject` with a reason code and a detail.

Reason codes are short and stable so reject counts aggregate across runs:
    invalid_utf8, invalid_json, not_an_object, missing_field:<name>, wrong_type:<name>, bad_role,
    empty_text, no_assistant_turn, too_short, too_long_chars
(tokenizing adds too_long and template_error). The detail says which field and what was found.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from data.cleaning import clean_text, has_surrogate

ROLES = ("system", "user", "assistant", "tool")
Messages = list[tuple[str, str]]


@dataclass(frozen=True)
class Reject:
    reason: str
    detail: str


@dataclass(frozen=True)
class RecordRules:
    """What a valid record is; built once from the stage config and shipped to the Ray workers."""

    format: str = "chat"
    text_field: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    system_field: str = "system"
    unicode_form: str = "NFC"
    min_chars: int = 1
    max_chars: int = 200_000

    @classmethod
    def from_config(cls, cfg) -> "RecordRules":
        return cls(cfg.format, cfg.text_field, cfg.prompt_field, cfg.response_field, cfg.system_field,
                   cfg.unicode_form, cfg.min_chars, cfg.max_chars)


def _type_name(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def decode_utf8(raw: bytes) -> str | Reject:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Reject("invalid_utf8", f"byte {e.start}: {raw[e.start:e.start + 4]!r} is not valid UTF-8")


def parse_json_object(text: str) -> dict | Reject:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return Reject("invalid_json", f"{e.msg} at column {e.colno}")
    if not isinstance(obj, dict):
        return Reject("not_an_object", f"the record is {_type_name(obj)}; expected a JSON object")
    return obj


def _clean_field(value, where: str, rules: RecordRules) -> str | Reject:
    if not isinstance(value, str):
        name = where.rsplit(".", 1)[-1]
        return Reject(f"wrong_type:{name}", f"{where} is {_type_name(value)}; expected a string")
    if has_surrogate(value):
        return Reject("invalid_utf8", f"{where} holds a lone surrogate (an escape like \\ud800 that is not text)")
    text = clean_text(value, rules.unicode_form)
    if not text:
        return Reject("empty_text", f"{where} is empty after cleaning")
    return text


def _messages(obj: dict, rules: RecordRules) -> Messages | Reject:
    if "messages" not in obj:
        return Reject("missing_field:messages", f"no 'messages' field (fields: {', '.join(sorted(obj)) or 'none'})")
    raw_messages = obj["messages"]
    if not isinstance(raw_messages, list):
        return Reject("wrong_type:messages", f"messages is {_type_name(raw_messages)}; expected a list of "
                      "{role, content} objects")
    if not raw_messages:
        return Reject("empty_text", "messages is an empty list")
    out: Messages = []
    for i, m in enumerate(raw_messages):
        if not isinstance(m, dict):
            return Reject("wrong_type:message", f"messages[{i}] is {_type_name(m)}; expected an object")
        if "role" not in m:
            return Reject("missing_field:role", f"messages[{i}] has no 'role'")
        if "content" not in m:
            return Reject("missing_field:content", f"messages[{i}] has no 'content'")
        role, content = m["role"], m["content"]
        if role not in ROLES:
            return Reject("bad_role", f"messages[{i}].role is {role!r}; expected one of {', '.join(ROLES)}")
        # Printable ASCII (most text) is clean once stripped: the whole of clean_text for it.
        if type(content) is str and content.isascii() and content.isprintable() and (text := content.strip()):
            out.append((role, text))
            continue
        content = _clean_field(content, f"messages[{i}].content", rules)
        if isinstance(content, Reject):
            return content
        out.append((role, content))
    if not any(role == "assistant" for role, _ in out):
        return Reject("no_assistant_turn", f"roles are {', '.join(r for r, _ in out)}; nothing to learn from")
    return out


def _instruction(obj: dict, rules: RecordRules) -> Messages | Reject:
    out: Messages = []
    if obj.get(rules.system_field) is not None:
        system = _clean_field(obj[rules.system_field], rules.system_field, rules)
        if isinstance(system, Reject):
            return system
        out.append(("system", system))
    for role, name in (("user", rules.prompt_field), ("assistant", rules.response_field)):
        if name not in obj:
            return Reject(f"missing_field:{name}", f"no '{name}' field (fields: {', '.join(sorted(obj)) or 'none'})")
        value = _clean_field(obj[name], name, rules)
        if isinstance(value, Reject):
            return value
        out.append((role, value))
    return out


def _check_length(chars: int, rules: RecordRules) -> Reject | None:
    if chars < rules.min_chars:
        return Reject("too_short", f"{chars} characters after cleaning; min_chars is {rules.min_chars}")
    if chars > rules.max_chars:
        return Reject("too_long_chars", f"{chars} characters after cleaning; max_chars is {rules.max_chars}")
    return None


def parse_record(raw: bytes, kind: str, rules: RecordRules) -> Messages | str | Reject:
    """Validate and clean one record: `kind` is the file kind (jsonl, parquet, text).

    Returns a list of (role, content) for chat and instruction formats, a string for raw text, or a Reject.
    """
    text = decode_utf8(raw)
    if isinstance(text, Reject):
        return text
    if kind == "text":
        if has_surrogate(text):
            return Reject("invalid_utf8", "the line holds a lone surrogate")
        cleaned = clean_text(text, rules.unicode_form)
        if not cleaned:
            return Reject("empty_text", "the line is empty after cleaning")
        return _check_length(len(cleaned), rules) or cleaned
    obj = parse_json_object(text)
    if isinstance(obj, Reject):
        return obj
    if rules.format == "text":
        if rules.text_field not in obj:
            return Reject(f"missing_field:{rules.text_field}",
                          f"no '{rules.text_field}' field (fields: {', '.join(sorted(obj)) or 'none'})")
        cleaned = _clean_field(obj[rules.text_field], rules.text_field, rules)
        if isinstance(cleaned, Reject):
            return cleaned
        return _check_length(len(cleaned), rules) or cleaned
    messages = _messages(obj, rules) if rules.format == "chat" else _instruction(obj, rules)
    if isinstance(messages, Reject):
        return messages
    return _check_length(sum(len(c) for _, c in messages), rules) or messages


def content_bytes(content: Messages | str) -> bytes:
    """The normalised content as bytes: what exact dedup compares."""
    if isinstance(content, str):
        return content.encode("utf-8")
    return "\x1e".join(f"{role}\x1f{text}" for role, text in content).encode("utf-8")
