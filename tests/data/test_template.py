import random

import pytest

from data.records import Reject
from data.template import ChatRenderer, Skeleton, TemplateSpec, content_is_opaque, jinja_render
from stack.tiny_model import CHAT_TEMPLATE

# Llama-3 style: system content pulled out with `set` and `| trim`, a default system prompt, a date.
LLAMA_LIKE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = 'You are helpful.' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] | trim %}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% generation %}{{- content ~ '<|eot_id|>' }}"
    "{% endgeneration %}"
    "{%- else %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
)
# Branches on what the content says: the skeleton would be wrong, so it must not be used.
THINKING = (
    "{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{%- if '</think>' in message.content %}{%- set answer = message.content.split('</think>')[-1] %}"
    "{%- else %}{%- set answer = message.content %}{%- endif %}"
    "<|im_start|>assistant\n{% generation %}{{ answer }}<|im_end|>{% endgeneration %}\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
)
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


def conversations(seed=0, n=60):
    rng = random.Random(seed)
    words = ["alpha", "beta", "{{ x }}", "<|eot_id|>", "ünïcödé", "12", "line\nbreak", "</think>", "  "]
    out = []
    for _ in range(n):
        turns = rng.randint(1, 4)
        conv = [("system", "Be brief.")] if rng.random() < 0.5 else []
        for _ in range(turns):
            conv.append(("user", " ".join(rng.choices(words, k=rng.randint(1, 8))).strip() or "q"))
            conv.append(("assistant", " ".join(rng.choices(words, k=rng.randint(0, 8))).strip()))
        out.append(conv)
    out.append([("user", "a"), ("user", "b"), ("assistant", "c")])  # breaks alternation
    out.append([("tool", "{\"ok\": true}"), ("assistant", "done")])
    out.append([("user", "only a question")])  # nothing to learn from
    return out


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, LLAMA_LIKE, THINKING], ids=["tiny", "llama-like", "thinking"])
def test_renders_exactly_as_jinja(template):
    spec = TemplateSpec(template, SPECIAL)
    renderer = ChatRenderer.build(spec)
    for conv in conversations():
        assert renderer.render(conv) == jinja_render(conv, spec), conv


def test_opacity_is_decided_from_the_syntax_tree():
    assert content_is_opaque(CHAT_TEMPLATE)
    assert content_is_opaque(LLAMA_LIKE)
    assert not content_is_opaque(THINKING)
    assert not content_is_opaque("{% for m in messages %}{% if m.content %}{{ m.content }}{% endif %}{% endfor %}")
    assert not content_is_opaque("{% for m in messages %}{{ m['content'][:10] }}{% endfor %}")
    assert not content_is_opaque("{% macro show(c) %}{{ c }}{% endmacro %}{% for m in messages %}{{ show(m.content) }}{% endfor %}")
    assert not content_is_opaque("{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    assert not content_is_opaque("{% for m in messages %}{{ m.content {% endfor %}")  # does not parse


def test_skeletons_are_used_where_the_template_allows():
    tiny = ChatRenderer.build(TemplateSpec(CHAT_TEMPLATE, SPECIAL))
    assert tiny.opaque and isinstance(tiny.skeletons[("user", "assistant")], Skeleton)
    text, spans = tiny.render([("user", "hi"), ("assistant", "yo")])
    assert text[spans[0]:spans[1]] == "yo<|im_end|>"
    llama = ChatRenderer.build(TemplateSpec(LLAMA_LIKE, SPECIAL))
    assert isinstance(llama.skeletons[("system", "user", "assistant")], Skeleton)
    bad = llama.render([("user", "a"), ("user", "b"), ("assistant", "c")])
    assert isinstance(bad, Reject) and bad.reason == "template_error" and "alternate" in bad.detail
    assert isinstance(llama.skeletons[("user", "user", "assistant")], Reject)  # decided once for the shape
    thinking = ChatRenderer.build(TemplateSpec(THINKING, SPECIAL))
    assert not thinking.opaque and not thinking.skeletons
    text, spans = thinking.render([("user", "q"), ("assistant", "plan</think>answer")])
    assert text[spans[0]:spans[1]] == "answer<|im_end|>"


def test_a_template_that_drops_a_content_falls_back_per_shape():
    # Prints the system content only when it is the first message: opaque, but the placeholder check
    # sees a missing placeholder for (user, system, assistant) and renders that shape with Jinja.
    template = ("{% for m in messages %}{% if m.role != 'system' or loop.first %}{{ m.role }}: "
                "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
                "{% else %}{{ m.content }}{% endif %}\n{% endif %}{% endfor %}")
    spec = TemplateSpec(template, {})
    renderer = ChatRenderer.build(spec)
    conv = [("user", "u"), ("system", "s"), ("assistant", "a")]
    assert renderer.render(conv) == jinja_render(conv, spec)
    assert renderer.skeletons[("user", "system", "assistant")] is None
