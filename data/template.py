"""The chat template, rendered fast: once per role sequence with placeholder contents, then per record by
splicing the record's contents into that skeleton.

A Jinja render costs tens of microseconds a record, as much as everything else the read tasks do
together. Most chat templates only ever *print* a message's content (`{{ message['content'] }}`, maybe
`| trim`), so for a given sequence of roles the output is fixed text with the contents in between, and
the `{% generation %}` spans sit at fixed places in it. That holds when:
  1. the template is *content-opaque*: its syntax tree uses `content` only where it is printed, joined
     with `+`/`~`, trimmed (contents are already stripped by cleaning) or type-tested (`is string`),
     directly or through a `{% set %}` variable; never in a condition, comparison, call or slice; and
  2. for the role sequence, a render with placeholder contents contains every placeholder once, in
     message order, with no generation boundary inside one, and a second render with other contents
     equals the spliced skeleton exactly (text and spans).
Anything else (a template that branches on content, an unseen shape) falls back to the Jinja render for
that record, so the output is the same either way; the fast path is only faster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from data.records import Messages, Reject

_PLACEHOLDER = re.compile("\x02(\\d+)\x03")  # control characters: cleaning removes them from every content
_GENERATION_TAG = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")
_SAFE_FILTERS = {"trim", "string"}
_SAFE_TESTS = {"string", "defined", "undefined", "none", "sameas"}
# Role sequences built in the driver, so read tasks seldom need Jinja (or transformers) at all.
COMMON_ROLES = [tuple(prefix + ["user", "assistant"] * turns) for prefix in ([], ["system"]) for turns in (1, 2, 3)]


@dataclass(frozen=True)
class TemplateSpec:
    """How content becomes the text the tokenizer sees."""

    chat_template: str | None
    special_tokens: dict[str, str] = field(default_factory=dict)
    eos_token: str = ""
    append_eos: bool = True


@dataclass(frozen=True)
class Skeleton:
    """The fixed text around n contents (n + 1 pieces) and each label boundary as (piece, offset)."""

    pieces: tuple[str, ...]
    boundaries: tuple[tuple[int, int], ...]  # start, end, start, end, ... of the {% generation %} spans

    def render(self, contents: list[str]) -> tuple[str, list[int]]:
        starts = [0]
        parts = [self.pieces[0]]
        for piece, content, after in zip(self.pieces, contents, self.pieces[1:]):
            starts.append(starts[-1] + len(piece) + len(content))
            parts += (content, after)
        text = "".join(parts)  # one copy of the contents, not one per piece
        flat = [starts[k] + o for k, o in self.boundaries]
        return text, [pos for s, e in zip(flat[::2], flat[1::2]) if e > s for pos in (s, e)]


def jinja_render(messages: Messages, template: TemplateSpec) -> tuple[str, list[int]] | Reject:
    """The template's own render (transformers' Jinja environment) with the assistant character spans."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, indices = render_jinja_template(
            [[{"role": r, "content": c} for r, c in messages]], chat_template=template.chat_template,
            return_assistant_tokens_mask=True, **template.special_tokens,
        )
    except Exception as e:  # a template may raise on purpose (e.g. "roles must alternate")
        return Reject("template_error", f"{type(e).__name__}: {e}")
    spans = [pos for start, end in indices[0] for pos in (start, end) if end > start]
    if not spans:
        return Reject("no_assistant_turn", "the chat template rendered no assistant ({% generation %}) text")
    return rendered[0], spans


def _content_access(node) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content"


def content_is_opaque(chat_template: str) -> bool:
    """True when the template's tree uses message content only in ways that cannot depend on its value
    (see the module docstring); False when it might, or when the template does not parse."""
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        tree = ImmutableSandboxedEnvironment().parse(_GENERATION_TAG.sub("", chat_template))
    except Exception:
        return False
    tainted: set[str] = set()

    def safe(path: list) -> bool:
        """`path` runs from the tree's root to a content value; every step up from it must pass it on."""
        child = path[-1]
        for parent in reversed(path[:-1]):
            if isinstance(parent, (nodes.Add, nodes.Concat)):
                child = parent
                continue
            if isinstance(parent, nodes.Filter) and parent.node is child and parent.name in _SAFE_FILTERS:
                child = parent
                continue
            if isinstance(parent, nodes.Test) and parent.node is child and parent.name in _SAFE_TESTS:
                return True  # a type test: the same for every string
            if isinstance(parent, nodes.Output):
                return True
            if isinstance(parent, nodes.Assign) and parent.node is child and isinstance(parent.target, nodes.Name):
                tainted.add(parent.target.name)
                return True
            return False
        return False

    changed = True
    while changed:
        before = set(tainted)
        stack = [[tree]]
        while stack:
            path = stack.pop()
            node = path[-1]
            if _content_access(node) or (isinstance(node, nodes.Name) and node.name in tainted and node.ctx == "load"):
                if not safe(path):
                    return False
                continue
            stack.extend(path + [child] for child in node.iter_child_nodes())
        changed = tainted != before
    return True


def _boundary(pos: int, placeholders: list[re.Match]) -> tuple[int, int] | None:
    """A position in the placeholder render as (literal piece k, offset in it); None inside a placeholder."""
    k = 0
    prev_end = 0
    for m in placeholders:
        if pos <= m.start():
            return k, pos - prev_end
        if pos < m.end():
            return None
        k, prev_end = k + 1, m.end()
    return k, pos - prev_end


def build_skeleton(roles: tuple[str, ...], template: TemplateSpec) -> Skeleton | Reject | None:
    """The skeleton for `roles`, the Reject every record with these roles gets (the template raised or
    marked nothing), or None when this shape must be rendered by Jinja record by record."""
    marked = jinja_render([(r, f"\x02{i}\x03") for i, r in enumerate(roles)], template)
    if isinstance(marked, Reject):
        return marked
    text, spans = marked
    found = list(_PLACEHOLDER.finditer(text))
    if [int(m.group(1)) for m in found] != list(range(len(roles))):
        return None
    boundaries = [_boundary(pos, found) for pos in spans]
    if any(b is None for b in boundaries):
        return None
    pieces = [text[a.end() if a else 0:b.start() if b else len(text)] for a, b in zip([None] + found, found + [None])]
    skeleton = Skeleton(tuple(pieces), tuple(boundaries))
    probe = [(r, f"Probe {'x' * i}{i}: some words,\nand {{{{ braces }}}}") for i, r in enumerate(roles)]
    if skeleton.render([c for _, c in probe]) != jinja_render(probe, template):
        return None
    return skeleton


@dataclass
class ChatRenderer:
    """Renders messages with the template: by skeleton where the template allows, else by Jinja."""

    template: TemplateSpec
    opaque: bool = False
    skeletons: dict[tuple[str, ...], Skeleton | Reject | None] = field(default_factory=dict)

    @classmethod
    def build(cls, template: TemplateSpec) -> "ChatRenderer":
        """In the driver: decide whether skeletons apply, and build the common role sequences' ones."""
        renderer = cls(template, opaque=bool(template.chat_template) and content_is_opaque(template.chat_template))
        if renderer.opaque:
            for roles in COMMON_ROLES:
                renderer.skeletons[roles] = build_skeleton(roles, template)
        return renderer

    def render(self, messages: Messages) -> tuple[str, list[int]] | Reject:
        if not self.opaque:
            return jinja_render(messages, self.template)
        roles = tuple(r for r, _ in messages)
        if roles not in self.skeletons:
            self.skeletons[roles] = build_skeleton(roles, self.template)
        skeleton = self.skeletons[roles]
        if skeleton is None:
            return jinja_render(messages, self.template)
        if isinstance(skeleton, Reject):
            return skeleton
        return skeleton.render([c for _, c in messages])
