"""A checkpoint's chat template rendered as transformers renders it (apply_chat_template with
tokenize=False), with jinja2 alone: the same sandbox, whitespace control, loop controls, filters
and globals the Hugging Face chat templates are written against."""
from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks; rendering
    to text keeps what it wraps as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """JSON as json.dumps writes it: jinja2's own filter escapes HTML characters, which templates do not want."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class PlainDict:
    """`dict(...)` and `dict.fromkeys(...)` in a template, without handing it the dict type itself."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class GuardedNamespace(jinja2.utils.Namespace):
    """jinja2's namespace() that refuses underscore-prefixed names, so a template cannot reach
    CPython's internals through one."""

    def __init__(*args, **kwargs):  # noqa: N805 (jinja2's Namespace takes self among *args too)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            GuardedNamespace.check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        GuardedNamespace.check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


class ChatTemplate:
    """One compiled template; rendering is thread-safe (the server's two tokenizer lanes share it)."""

    def __init__(self, source: str):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[GenerationBlock, jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=PlainDict(),
                           namespace=GuardedNamespace)
        self.template = env.from_string(source)

    def render(self, messages: list[dict], add_generation_prompt: bool, special_tokens: dict[str, str]) -> str:
        """The conversation (messages of plain strings; keys whose value is None left out, as transformers
        does), with the tokenizer's named special tokens as variables."""
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return self.template.render(**special_tokens, messages=messages, tools=None, documents=None,
                                    add_generation_prompt=add_generation_prompt)
