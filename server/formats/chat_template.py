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

Thread-safe: the generation tracker is a ContextVar, the compiled template is read-only.
"""

from __future__ import annotations

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

    def __init__(self, text: str, special: dict[str, str], loss_on: str) -> None:
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

    @classmethod
    def for_tokenizer(cls, tokenizer: str | Path, override: str | None, loss_on: str
                      ) -> ChatTemplate:
        config = read_tokenizer_config(tokenizer)
        special = {k: t for k in SPECIAL if (t := _token_text(config.get(k))) is not None}
        text = template_text(config, override, str(Path(tokenizer).with_name(
            "tokenizer_config.json")))
        return cls(text, special, loss_on)

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
        if not self.markers:
            spans = self._prefix_spans(messages, text)
        if self.loss_on == "last_assistant":
            spans = spans[-1:]
        return text, spans

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
