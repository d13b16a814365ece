"""Record validation and cleaning: each malformed record gets its reason; good ones come out normalised."""

import json

import pytest

from data.cleaning import clean_text
from data.records import RecordRules, Reject, content_bytes, parse_record
from stack.sample_corpus import malformed_lines

CHAT = RecordRules(format="chat")


def chat_line(*messages, **extra) -> bytes:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in messages], **extra}).encode()


def test_sample_malformed_records_get_their_reasons():
    reasons = {}
    for raw in malformed_lines():
        result = parse_record(raw, "jsonl", CHAT)
        ident = raw.split(b'"id": "')[1].split(b'"')[0].decode() if b'"id": "' in raw else raw.decode()
        reasons[ident] = result.reason if isinstance(result, Reject) else "ok"
    assert reasons == {
        "bad-json": "invalid_json",
        "no-messages": "missing_field:messages",
        "messages-not-list": "wrong_type:messages",
        "empty-assistant-text": "empty_text",
        "content-not-string": "wrong_type:content",
        "unknown-role": "bad_role",
        "invalid-utf8": "invalid_utf8",
        "no-assistant": "no_assistant_turn",
        "over-length": "ok",  # valid JSON; it is too long in tokens, which tokenizing decides
        "[1, 2, 3]": "not_an_object",
    }


def test_reject_details_name_the_field():
    result = parse_record(chat_line(("user", "hi"), ("assistant", 4)), "jsonl", CHAT)
    assert result == Reject("wrong_type:content", "messages[1].content is an integer; expected a string")
    result = parse_record(b'{"messages": [{"role": "user"}]}', "jsonl", CHAT)
    assert result.reason == "missing_field:content" and "messages[0]" in result.detail


def test_good_chat_record_is_cleaned():
    raw = chat_line(("system", "Be\u00a0brief.\r\n"), ("user", "Cafe\u0301?\x07  \n\n\n\nok"), ("assistant", " yes "))
    assert parse_record(raw, "jsonl", CHAT) == [("system", "Be brief."), ("user", "Café?\n\nok"), ("assistant", "yes")]


def test_instruction_record_maps_to_chat():
    rules = RecordRules(format="instruction")
    raw = json.dumps({"prompt": "What is 2 + 2?", "response": "4", "system": "Terse."}).encode()
    assert parse_record(raw, "jsonl", rules) == [("system", "Terse."), ("user", "What is 2 + 2?"), ("assistant", "4")]
    missing = parse_record(json.dumps({"prompt": "x"}).encode(), "jsonl", rules)
    assert missing.reason == "missing_field:response"


def test_text_records_from_jsonl_and_plain_lines():
    rules = RecordRules(format="text", min_chars=3, max_chars=20)
    assert parse_record(b'{"text": "  hello\\tworld "}', "jsonl", rules) == "hello\tworld"
    assert parse_record("plain line\r".encode(), "text", rules) == "plain line"
    assert parse_record(b"ab", "text", rules).reason == "too_short"
    assert parse_record(b"x" * 21, "text", rules).reason == "too_long_chars"
    assert parse_record(b'{"body": "x"}', "jsonl", rules).reason == "missing_field:text"


def test_lone_surrogate_is_invalid_utf8():
    raw = b'{"messages": [{"role": "user", "content": "a\\ud800b"}, {"role": "assistant", "content": "c"}]}'
    assert parse_record(raw, "jsonl", CHAT).reason == "invalid_utf8"


@pytest.mark.parametrize("text, expected", [
    ("e\u0301", "\u00e9"),                     # NFC composes
    ("a\u00a0b\u3000c", "a b c"),              # odd spaces become spaces
    ("a\r\nb\rc\u2028d", "a\nb\nc\nd"),        # line breaks unified
    ("a\x00b\x1bc\x7f", "abc"),                # control characters dropped
    ("line  \nnext\t\n", "line\nnext"),        # trailing blanks dropped
    ("a\n\n\n\n\nb", "a\n\nb"),                # at most one empty line
    ("    def f():\n        return 1", "def f():\n        return 1"),  # inner indentation kept
    ("👩\u200d💻", "👩\u200d💻"),              # ZWJ sequences kept
])
def test_clean_text(text, expected):
    assert clean_text(text) == expected


def test_nfkc_is_optional():
    assert clean_text("ﬁ") == "ﬁ" and clean_text("ﬁ", "NFKC") == "fi"


def test_content_bytes_tell_roles_apart():
    # Cleaning drops the \x1e/\x1f separators content_bytes uses, so two conversations cannot collide.
    assert clean_text("a\x1eb\x1fc") == "abc"
    assert content_bytes([("user", "a")]) != content_bytes([("assistant", "a")])
    assert content_bytes([("user", "a b")]) != content_bytes([("user", "a"), ("user", "b")])
