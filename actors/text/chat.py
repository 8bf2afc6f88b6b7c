"""A checkpoint's chat template: messages to the prompt text the model was tuned on.

The template is ``chat_template.jinja`` beside the tokenizer (transformers 5 writes it) or,
without that file, ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
``{name, template}`` of which "default" is used); a GGUF file's is its
``tokenizer.chat_template`` metadata. It renders exactly as transformers'
``apply_chat_template`` renders it (``transformers/utils/chat_template_utils.py``): a
sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the loop-control
extension, a ``{% generation %}`` tag that renders its body, the globals
``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``, a ``tojson`` filter that
does not escape HTML, and the variables ``messages``, ``tools`` and ``documents`` (None),
``add_generation_prompt`` and the named special-token strings (``bos_token``...).
Messages are passed as plain JSON data, keys whose value is None dropped, and a message's
reasoning under any of its three names is also given as ``reasoning_content`` and
``thinking``. Token ids are the tokenizer's encoding of the text without adding specials,
as ``apply_chat_template(tokenize=True)`` does.

Templates are untrusted code from a model hub: the sandbox is why jinja2 >= 3.1.6.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ringfence.actors.text.gguf_metadata import is_gguf, metadata
from ringfence.actors.text.gguf_tokenizer import gguf_special_tokens
from ringfence.actors.text.special_tokens import TOKENIZER_CONFIG, read_json, token_entries
from ringfence.actors.text.tokenizer import Tokenizer
from ringfence.shm.errors import RingfenceError

TEMPLATE_FILE = "chat_template.jinja"
GGUF_TEMPLATE_KEY = "tokenizer.chat_template"  # a GGUF file's template, in its metadata
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # first: what templates read

Message = Mapping[str, Any]


class ChatTemplateError(RingfenceError, ValueError):
    """A chat template is missing, does not compile, or refused the messages."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates, without the attributes of the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` for templates: no underscore-prefixed attributes (CPython internals)."""

    # The signature of Jinja's Namespace, so that ``namespace(self=...)`` still works.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
            )


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks):
    renders its body, which is all that serving needs of it."""

    tags = {"generation"}  # noqa: RUF012 - the type Extension declares

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        text: str = caller()
        return text


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain(value: Any) -> Any:
    """``value`` rebuilt of exact JSON types (what the sandbox may safely see)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return f"<{type(value).__name__}>"


def _chat(messages: object) -> list[dict[str, Any]]:
    if not isinstance(messages, list | tuple) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of message objects")
    chat: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{index}] must be an object, got {message!r}")
        plain = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((plain[k] for k in REASONING_FIELDS if plain.get(k) is not None), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        chat.append(plain)
    return chat


class ChatTemplate:
    """One compiled chat template with its checkpoint's special-token strings.

    Immutable after construction; rendering holds no state, so threads may share one.
    """

    def __init__(self, source: str, *, origin: str, variables: Mapping[str, str]) -> None:
        """Compile ``source``; ChatTemplateError naming ``origin`` (its file) if it does not."""
        self.origin = origin  # the file the template came from, for error messages
        self.source = source  # the template's text (what it writes: a tool-call format)
        self.variables = dict(variables)  # bos_token, eos_token... as the template sees them
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"{origin}: the chat template does not compile: {exc.message} (line {exc.lineno})"
            ) from None

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ChatTemplate:
        """The template of the checkpoint at ``path``; ChatTemplateError if it has none."""
        root = Path(path)
        source, origin = find_template(root)
        if source is None:
            raise ChatTemplateError(
                f"checkpoint {root} has no chat template (no {TEMPLATE_FILE}, and "
                f"{TOKENIZER_CONFIG} has no chat_template): give prompt or prompt_token_ids"
            )
        return cls(source, origin=origin, variables=_token_strings(root))

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text of ``messages`` (objects with at least ``role``), opening the
        assistant's turn when ``add_generation_prompt``, offering ``tools`` (OpenAI's tool
        objects) where the template writes them. ChatTemplateError naming the template's
        file if the template refuses them (its ``raise_exception``)."""
        chat = _chat(messages)
        try:
            text: str = self._template.render(
                **_plain(self.variables),
                messages=chat,
                tools=_plain(list(tools)) if tools else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"{self.origin}: {exc}") from None
        return text

    def encode(
        self,
        tokenizer: Tokenizer,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat: ``tokenizer``'s encoding, no specials added
        (the template writes its own bos)."""
        text = self.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        return tokenizer.encode(text)


def _token_strings(root: Path) -> dict[str, str]:
    """The named special-token strings (bos_token...) the template sees."""
    if is_gguf(root):
        return dict(gguf_special_tokens(root).strings)
    return {
        key: value if isinstance(value, str) else value["content"]
        for key, value in token_entries(root).items()
    }


def find_template(root: Path) -> tuple[str | None, str]:
    """The template source (None if none) and the file it is in."""
    if is_gguf(root):
        source = metadata(root, GGUF_TEMPLATE_KEY)
        if source is not None and not isinstance(source, str):
            raise ChatTemplateError(f"{root}: {GGUF_TEMPLATE_KEY}: must be a string")
        return source, f"{root} ({GGUF_TEMPLATE_KEY})"
    file = root / TEMPLATE_FILE
    if file.exists():
        return file.read_text(encoding="utf-8"), str(file)
    config_file = root / TOKENIZER_CONFIG
    template = read_json(config_file).get("chat_template")
    origin = f"{config_file} (chat_template)"
    if template is None or isinstance(template, str):
        return template, origin
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"], f"{config_file} (chat_template 'default')"
        raise ChatTemplateError(
            f"{config_file}: chat_template lists no 'default' template (names: "
            f"{sorted(str(name) for name in named)})"
        )
    raise ChatTemplateError(
        f"{config_file}: chat_template must be a string or a list of {{name, template}}, "
        f"got {type(template).__name__}"
    )
