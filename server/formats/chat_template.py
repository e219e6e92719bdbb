"""Chat templates for `format: chat`, rendered the way `transformers` renders them.

The template is a tokenizer_config.json's `chat_template` (or the dataset's own, inline or
a .jinja file), compiled in Jinja2's ImmutableSandboxedEnvironment with what
`transformers.utils.chat_template_utils` gives a template: trim_blocks, lstrip_blocks, the
loopcontrols extension, the `{% generation %}` block, a `tojson` that does not escape HTML,
`raise_exception`, `strftime_now`, `dict` and a `namespace` that refuses underscore names;
the variables `messages`, `tools=None`, `documents=None`, `add_generation_prompt=False` and
the tokenizer's special tokens (`bos_token`, `eos_token`, ...). Messages are copied with their
None-valued keys dropped and the reasoning under every name templates read, as transformers
does before rendering.

`render(messages)` returns the text and the character spans trained on:
- with `{% generation %}` markers in the template, the text each such block rendered;
- without, the prefix rule: an assistant message's span is what rendering messages[:i+1]
  adds to rendering messages[:i] with `add_generation_prompt=True` (so the assistant header
  the generation prompt writes is not trained on), or to messages[:i] without it when the
  first is not a prefix. A template whose renderings are not prefixes of each other (one that
  rewrites earlier turns) cannot be masked this way: TemplateError says so.
- without markers, where the template ends its turns with an end-of-turn token (the dataset's
  `end_of_turn`, else the tokenizer config's `eos_token`), the end-of-turn rule: the prefix
  rule's span cut right after the last end-of-turn token in it, so what the template writes
  after the token (ChatML's and Gemma's newline) is not trained on, as with markers around
  the message and its end-of-turn token (TRL's assistant-only loss, axolotl's
  `train_on_eos: turn`). `Rule` says which of the three a template uses.

Thread-safe: the generation tracker is a ContextVar, the compiled template is read-only.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The special tokens transformers passes to a template (its special_tokens_map).
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
           "mask_token")
REASONING = ("reasoning_content", "thinking", "reasoning")
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
LOSS_ON = ("assistant", "last_assistant", "all")


# What `Rule.of` renders to see whether a template writes its end-of-turn token in a turn.
PROBE = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"})


class Rule(enum.Enum):
    """Where an assistant span ends when the template has no markers (see the module's doc)."""

    MARKERS = "markers"  # the {% generation %} blocks
    END_OF_TURN = "end of turn"  # the prefix rule's span, cut after the end-of-turn token
    PREFIX = "prefix"  # the prefix rule's span, all of it


class TemplateError(ValueError):
    """A conversation the template cannot render or mask; the message says why."""


_tracking: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar(
    "stoker_chat_generation", default=None)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: records the span its body rendered."""

    # jinja2 declares `tags` on Extension as an instance attribute, though it reads it from the
    # class: so the same declaration here, not a ClassVar.
    tags = {"generation"}  # noqa: RUF012

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_support"), [], [], body
                                      ).set_lineno(lineno)

    def _support(self, caller: Any) -> str:
        rv = caller()
        tracking = _tracking.get()
        if tracking is not None:
            blocks, spans = tracking
            start = sum(map(len, blocks))
            spans.append((start, start + len(rv)))
        return rv


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _Dict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's own signature: self may be a key
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot store {name!r} on a namespace")


def compile_template(text: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, dict=_Dict(), namespace=_Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(text)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken as tokenizer_config.json writes it
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer_config(tokenizer: str | Path) -> dict[str, Any]:
    """The tokenizer_config.json beside `tokenizer`, {} when there is none."""
    path = Path(tokenizer).with_name("tokenizer_config.json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def template_text(tokenizer_config: dict[str, Any], override: str | None, where: str) -> str:
    """The template: `override` (inline text, or a file when it has no `{`), else the
    tokenizer config's `chat_template` (a string, or the one named `default` in a list)."""
    if override is not None:
        if "{" in override:
            return override
        return Path(override).read_text(encoding="utf-8")
    found = tokenizer_config.get("chat_template")
    if isinstance(found, list):  # [{"name": ..., "template": ...}]
        found = next((t.get("template") for t in found
                      if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(found, str):
        raise ValueError(f"{where}: no chat_template; set `chat_template:` in the dataset "
                         "(inline or a .jinja file)")
    return found


def _normalize(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise TemplateError(f"expected a non-empty list of messages, got "
                            f"{_kind(messages)}")
    out = []
    for n, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TemplateError(f"message {n}: expected an object with role and content, got "
                                f"{_kind(m)}")
        if not isinstance(m.get("role"), str):
            raise TemplateError(f"message {n}: no role (a string)")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _kind(value: Any) -> str:
    return "an empty list" if value == [] else type(value).__name__


class ChatTemplate:
    """A compiled template with its special tokens; `render` is the only entry point."""

    def __init__(self, text: str, special: dict[str, str], loss_on: str,
                 end_of_turn: str | None = None) -> None:
        """`end_of_turn`: the token that ends the template's turns, when it is not the
        tokenizer's `eos_token` (Llama 3's <|eot_id|>, Gemma's <end_of_turn>)."""
        if loss_on not in LOSS_ON:
            raise ValueError(f"loss_on: expected one of {LOSS_ON}, got {loss_on!r}")
        self.text = text
        self.special = special
        self.loss_on = loss_on
        self.markers = bool(GENERATION.search(text))
        try:
            self._template = compile_template(text)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"chat_template line {e.lineno}: {e.message}") from None
        self.rule, self.end_of_turn = self._rule(end_of_turn)

    @classmethod
    def for_tokenizer(cls, tokenizer: str | Path, override: str | None, loss_on: str,
                      end_of_turn: str | None = None) -> ChatTemplate:
        config = read_tokenizer_config(tokenizer)
        special = {k: t for k in SPECIAL if (t := _token_text(config.get(k))) is not None}
        text = template_text(config, override, str(Path(tokenizer).with_name(
            "tokenizer_config.json")))
        return cls(text, special, loss_on, end_of_turn)

    def _rule(self, given: str | None) -> tuple[Rule, str | None]:
        """(the rule, the end-of-turn token it cuts at). An `end_of_turn` the dataset names
        must be in the probe's assistant turn; the `eos_token` decides only where it is (a
        template may not write it, or write it once at the end of the conversation)."""
        if self.markers:
            return Rule.MARKERS, None
        token = given if given is not None else self.special.get("eos_token")
        if not token:
            return Rule.PREFIX, None
        text = ""
        try:
            text = self._render(list(PROBE))[0]
            spans = self._prefix_spans(list(PROBE), text)
            written = any(token in text[a:b] for a, b in spans)
        except TemplateError:  # a template that refuses the probe: does it name the token?
            written = token in self.text or (given is None and "eos_token" in self.text)
        if written:
            return Rule.END_OF_TURN, token
        if given is not None:
            raise ValueError(f"end_of_turn: the chat template does not write {token!r} in an "
                             f"assistant turn (rendered: {text!r})")
        return Rule.PREFIX, None

    def describe(self) -> str:
        """Which rule masks the conversations, in a line (`stoker check`)."""
        if self.rule is Rule.MARKERS:
            return "masks: {% generation %} markers: the spans the template marks"
        if self.rule is Rule.END_OF_TURN:
            return (f"masks: end-of-turn rule: an assistant turn ends right after "
                    f"{self.end_of_turn!r}; what the template writes after it is not trained")
        return ("masks: prefix rule: the template's turns have no end-of-turn token (set "
                "end_of_turn), so an assistant span is all its turn adds")

    @contextmanager
    def _tracked(self) -> Iterator[tuple[list[str], list[tuple[int, int]]]]:
        state: tuple[list[str], list[tuple[int, int]]] = ([], [])
        token = _tracking.set(state)
        try:
            yield state
        finally:
            _tracking.reset(token)

    def _render(self, messages: list[dict[str, Any]], prompt: bool = False
                ) -> tuple[str, list[tuple[int, int]]]:
        try:
            with self._tracked() as (blocks, spans):
                for block in self._template.generate(
                        messages=messages, tools=None, documents=None,
                        add_generation_prompt=prompt, **self.special):
                    blocks.append(block)
                return "".join(blocks), spans
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"chat_template: {type(e).__name__}: {e}") from None
        except Exception as e:  # the template's own code failed (a bad index, a type)
            raise TemplateError(f"chat_template: {type(e).__name__}: {e}") from None

    def render(self, messages: Any) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the sorted character spans trained on)."""
        messages = _normalize(messages)
        text, spans = self._render(messages)
        if self.loss_on == "all":
            return text, [(0, len(text))]
        if self.rule is not Rule.MARKERS:
            spans = self._prefix_spans(messages, text)
        if self.rule is Rule.END_OF_TURN:
            spans = [self._cut(text, a, b) for a, b in spans]
        if self.loss_on == "last_assistant":
            spans = spans[-1:]
        return text, spans

    def _cut(self, text: str, a: int, b: int) -> tuple[int, int]:
        """The span (a, b) cut right after the last end-of-turn token in it (a turn's content
        may hold the token's text too: the template's own is the last); whole without one."""
        assert self.end_of_turn is not None
        at = text.rfind(self.end_of_turn, a, b)
        return (a, at + len(self.end_of_turn)) if at >= 0 else (a, b)

    def _prefix_spans(self, messages: list[dict[str, Any]], text: str
                      ) -> list[tuple[int, int]]:
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            upto = self._render(messages[: i + 1])[0]
            if not text.startswith(upto):
                raise TemplateError(f"message {i}: the rendering of the messages up to it is "
                                    "not a prefix of the whole conversation's, so the span "
                                    "it adds is not defined; add {% generation %} markers "
                                    "to the template")
            start = None
            for prompt in (True, False):
                before = self._render(messages[:i], prompt)[0] if i else ""
                if upto.startswith(before):
                    start = len(before)
                    break
            if start is None:
                raise TemplateError(f"message {i}: the rendering of the messages before it "
                                    "is not a prefix of the rendering with it; add "
                                    "{% generation %} markers to the template")
            spans.append((start, len(upto)))
        return spans
