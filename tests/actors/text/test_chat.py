"""Chat templates and special tokens of a checkpoint, against transformers' apply_chat_template.

Every tokenizer is trained here (a small byte-level BPE with chat control tokens); nothing
is downloaded.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from ringfence.actors.config import Config
from ringfence.actors.engine.config import EngineConfig
from ringfence.actors.engine.intake import Intake, check_workload
from ringfence.actors.model.config import ModelConfig
from ringfence.actors.protocol.client import Submit
from ringfence.actors.text.chat import ChatTemplate, ChatTemplateError
from ringfence.actors.text.tokenizer import load_tokenizer
from ringfence.sched.request import RequestError, SamplingParams

tokenizers = pytest.importorskip("tokenizers", reason="tokenizer.json needs tokenizers")
transformers = pytest.importorskip("transformers", reason="the reference is transformers")

CONTROL = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>",
]  # fmt: skip
CORPUS = [
    "You are a helpful assistant. Answer briefly and kindly.",
    "What is a KV cache? It keeps the keys and values of past tokens.",
    'Héllo wörld: naïve café, 1 + 2 = 3; <b>bold</b> & "quotes".',
    "user assistant system tool\n\n  indented line\tand a tab",
] * 20

# Llama 3 Instruct's template as published.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
# Qwen2's ChatML template, with its default system prompt, written over several lines the
# way multi-line templates are: trim_blocks and lstrip_blocks decide its whitespace.
QWEN2 = """\
{% for message in messages %}
    {% if loop.first and messages[0]['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {% endif %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{% endif %}
"""
# Mistral-style: roles must alternate, or raise_exception.
ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
# tojson (no HTML escaping, indent), namespace, loop controls and a generation block.
JSONISH = """\
{%- set ns = namespace(system=none) -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}{%- set ns.system = message.content -%}{%- continue -%}
    {%- endif -%}
    {%- if message.role == 'assistant' -%}
{% generation %}{{ message | tojson }}{% endgeneration %}
    {%- else -%}
{{ message | tojson(indent=2, sort_keys=true) }}
    {%- endif %}

{% endfor -%}
{{- {'system': ns.system, 'eos': eos_token} | tojson -}}
{%- if add_generation_prompt %}<|im_start|>{% endif -%}
"""
TEMPLATES = {"llama3": LLAMA3, "qwen2": QWEN2, "alternating": ALTERNATING, "jsonish": JSONISH}

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "What is a KV cache?"}],
    "system then user": [SYSTEM, {"role": "user", "content": 'Héllo <b>wörld</b> & "you"'}],
    "multi-turn": [
        SYSTEM,
        {"role": "user", "content": "  What is 1 + 2?  "},
        {"role": "assistant", "content": "3."},
        {"role": "user", "content": "And\n\ttimes 2?"},
    ],
    "user and assistant": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, naïve café."},
        {"role": "user", "content": "Bye"},
    ],
}


@cache
def trained_tokenizer_json() -> str:
    """A byte-level BPE of 400 ids trained on CORPUS, with CONTROL as special tokens."""
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=CONTROL,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return str(tokenizer.to_str())


def write_checkpoint(
    root: Path,
    template: str | list[dict[str, str]] | None,
    *,
    bos: Any = "<|begin_of_text|>",
    eos: Any = "<|eot_id|>",
    **files: dict[str, Any],
) -> Path:
    """tokenizer.json, a tokenizer_config.json naming bos/eos and the template, and
    ``files`` (name without .json -> content)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").write_text(trained_tokenizer_json())
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    config |= {"bos_token": bos, "eos_token": eos}
    if template is not None:
        config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in files.items():
        (root / f"{name}.json").write_text(json.dumps(content))
    return root


def reference(root: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(root))


def ours(root: Path) -> tuple[Any, ChatTemplate]:
    tokenizer = load_tokenizer(root)
    assert tokenizer is not None
    return tokenizer, ChatTemplate.from_checkpoint(root)


def good_conversations(name: str) -> dict[str, list[dict[str, str]]]:
    if name != "alternating":
        return CONVERSATIONS
    return {k: v for k, v in CONVERSATIONS.items() if k in ("one user turn", "user and assistant")}


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_rendered_text_and_its_ids_equal_transformers_for_every_conversation(
    tmp_path: Path, name: str, add_generation_prompt: bool
) -> None:
    root = write_checkpoint(tmp_path, TEMPLATES[name])
    hf = reference(root)
    tokenizer, template = ours(root)
    for label, messages in good_conversations(name).items():
        text = template.render(messages, add_generation_prompt=add_generation_prompt)
        expected = hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert text == expected, label
        ids = hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        ours_ids = template.encode(tokenizer, messages, add_generation_prompt=add_generation_prompt)
        assert ours_ids == ids, label
        assert tokenizer.decode(ids) == hf.decode(ids, skip_special_tokens=True), label


def test_the_control_tokens_of_a_rendered_chat_are_single_ids(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path, LLAMA3)
    tokenizer, template = ours(root)
    ids = template.encode(tokenizer, CONVERSATIONS["one user turn"])
    vocab = {token: tokenizer._tokenizer.token_to_id(token) for token in CONTROL}
    assert ids[:2] == [vocab["<|begin_of_text|>"], vocab["<|start_header_id|>"]]
    assert ids[-2:] == [vocab["<|end_header_id|>"], tokenizer.encode("\n\n")[0]]
    assert ids.count(vocab["<|eot_id|>"]) == 1


def test_a_role_the_template_refuses_raises_its_message_naming_the_file(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path, ALTERNATING)
    _, template = ours(root)
    messages = CONVERSATIONS["system then user"]
    with pytest.raises(transformers.utils.chat_template_utils.jinja2.TemplateError) as theirs:
        reference(root).apply_chat_template(messages, tokenize=False)
    with pytest.raises(ChatTemplateError) as caught:
        template.render(messages)
    assert str(caught.value) == f"{root / 'tokenizer_config.json'} (chat_template): {theirs.value}"
    assert isinstance(caught.value, ValueError)
    assert "roles must alternate" in str(caught.value)


def test_the_list_form_uses_its_default_and_chat_template_jinja_wins_over_the_config(
    tmp_path: Path,
) -> None:
    listed = [{"name": "tool_use", "template": "tools!"}, {"name": "default", "template": QWEN2}]
    root = write_checkpoint(tmp_path, listed)
    messages = CONVERSATIONS["multi-turn"]
    _, template = ours(root)
    assert template.render(messages) == reference(root).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    (root / "chat_template.jinja").write_text(LLAMA3)
    _, template = ours(root)
    assert template.origin == str(root / "chat_template.jinja")
    assert template.render(messages) == reference(root).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert template.render(messages).startswith("<|begin_of_text|><|start_header_id|>system")


def test_a_list_without_a_default_template_names_the_file_and_the_names(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path, [{"name": "tool_use", "template": "x"}])
    with pytest.raises(
        ChatTemplateError, match=r"tokenizer_config\.json: .*no 'default'.*tool_use"
    ):
        ChatTemplate.from_checkpoint(root)


def test_a_template_that_does_not_compile_names_its_file(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path, "{% for m in messages %}{{ m.content }}")
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config\.json \(chat_template\): "):
        ChatTemplate.from_checkpoint(root)
    (root / "chat_template.jinja").write_text("{{ messages[0].content }")
    with pytest.raises(ChatTemplateError, match=r"chat_template\.jinja: .*does not compile"):
        ChatTemplate.from_checkpoint(root)


def test_a_checkpoint_without_a_template_says_it_has_none(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path, None)
    with pytest.raises(ChatTemplateError, match=r"has no chat template \(no chat_template\.jinja"):
        ChatTemplate.from_checkpoint(root)


def test_a_template_cannot_reach_python_internals(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        ours(root)[1].render(CONVERSATIONS["one user turn"])


def test_an_empty_chat_is_refused(tmp_path: Path) -> None:
    _, template = ours(write_checkpoint(tmp_path, LLAMA3))
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        template.render([])


# Special tokens and stop ids


def test_every_eos_id_of_generation_config_is_a_stop_id_after_the_tokenizers_eos(
    tmp_path: Path,
) -> None:
    root = write_checkpoint(
        tmp_path,
        LLAMA3,
        config={"bos_token_id": 9, "eos_token_id": 7},
        generation_config={"bos_token_id": 9, "eos_token_id": [1, 4, 1]},
    )
    tokenizer = load_tokenizer(root)
    hf = reference(root)
    assert tokenizer is not None
    assert (tokenizer.bos, tokenizer.eos) == (hf.bos_token_id, hf.eos_token_id) == (0, 4)
    assert tokenizer.stop_ids == (4, 1)


def test_without_tokenizer_tokens_or_generation_config_config_json_names_bos_and_eos(
    tmp_path: Path,
) -> None:
    root = write_checkpoint(tmp_path, None, config={"bos_token_id": 3, "eos_token_id": [2, 5]})
    config = json.loads((root / "tokenizer_config.json").read_text())
    del config["bos_token"], config["eos_token"]
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(root)
    assert tokenizer is not None
    assert (tokenizer.bos, tokenizer.eos, tokenizer.stop_ids) == (3, 2, (2, 5))


def test_added_token_objects_and_the_legacy_special_tokens_map_resolve_like_transformers(
    tmp_path: Path,
) -> None:
    added = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "rstrip": False}
    root = write_checkpoint(
        tmp_path,
        ALTERNATING,
        bos=added,
        eos="<|eot_id|>",
        special_tokens_map={"eos_token": {"content": "</s>", "normalized": False}},
    )
    hf = reference(root)
    tokenizer, template = ours(root)
    assert (tokenizer.bos, tokenizer.eos) == (hf.bos_token_id, hf.eos_token_id)
    assert template.variables["eos_token"] == hf.eos_token == "</s>"
    messages = CONVERSATIONS["user and assistant"]
    assert template.render(messages) == hf.apply_chat_template(messages, tokenize=False)


def test_a_named_token_missing_from_tokenizer_json_is_added_as_transformers_adds_it(
    tmp_path: Path,
) -> None:
    root = write_checkpoint(tmp_path, LLAMA3, bos="<|fresh|>")
    hf = reference(root)
    tokenizer, template = ours(root)
    messages = CONVERSATIONS["one user turn"]
    new_id = tokenizers.Tokenizer.from_str(trained_tokenizer_json()).get_vocab_size()
    assert tokenizer.bos == hf.bos_token_id == new_id
    assert template.encode(tokenizer, messages) == hf.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False
    )


def test_a_tokenizer_json_that_does_not_parse_names_the_file(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path, LLAMA3)
    (root / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a tokenizer"):
        load_tokenizer(root)


@pytest.mark.parametrize("name", ["tokenizer_config", "generation_config", "config"])
def test_a_config_that_does_not_parse_names_the_file(tmp_path: Path, name: str) -> None:
    root = write_checkpoint(tmp_path, LLAMA3)
    (root / f"{name}.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"/{name}\.json: invalid JSON"):
        load_tokenizer(root)


def test_a_non_integer_eos_id_names_the_file_and_key(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path, LLAMA3, generation_config={"eos_token_id": ["x"]})
    with pytest.raises(ValueError, match=r"generation_config\.json: eos_token_id must be"):
        load_tokenizer(root)


# The engine's intake


def intake(tmp_path: Path, workload: list[dict[str, Any]], *, path: str) -> Intake:
    file = tmp_path / "workload.jsonl"
    file.write_text("".join(json.dumps(line) + "\n" for line in workload))
    config = Config(
        model=ModelConfig(path=path), engine=EngineConfig(workload=str(file), arrivals=False)
    )
    check_workload(config)
    made = Intake(config)
    made.load()
    return made


def test_a_workload_chat_becomes_the_ids_transformers_gives_and_stops_at_every_eos(
    tmp_path: Path,
) -> None:
    root = write_checkpoint(
        tmp_path / "ckpt", QWEN2, eos="<|im_end|>", generation_config={"eos_token_id": [8, 1]}
    )
    messages = CONVERSATIONS["multi-turn"]
    lines: list[dict[str, Any]] = [
        {"id": "chat", "messages": messages, "max_tokens": 4, "stop_token_ids": [9]},
        {"id": "text", "prompt": "What is a KV cache?"},
    ]
    made = intake(tmp_path, lines, path=str(root))
    chat, text = (made.request(line) for line in made.workload)
    hf = reference(root)
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert list(chat.prompt_token_ids) == expected
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    assert chat.params == SamplingParams(max_tokens=4, stop_token_ids=(9, im_end, 8, 1))
    assert list(text.prompt_token_ids) == hf.encode("What is a KV cache?", add_special_tokens=False)
    assert text.params.stop_token_ids == (im_end, 8, 1)


def test_a_workload_chat_for_a_preset_is_an_error_naming_the_preset(tmp_path: Path) -> None:
    lines = [{"id": "chat", "messages": CONVERSATIONS["one user turn"]}]
    with pytest.raises(ValueError, match=r"request 'chat': messages: model\.preset 'tiny' has no"):
        intake(tmp_path, lines, path="")


def test_a_preset_request_keeps_only_its_own_stop_tokens(tmp_path: Path) -> None:
    made = intake(tmp_path, [{"id": "t", "prompt": "hi", "stop_token_ids": [3]}], path="")
    assert made.request(made.workload[0]).params.stop_token_ids == (3,)


def test_a_chat_the_template_refuses_fails_the_workload_check_naming_the_request(
    tmp_path: Path,
) -> None:
    root = write_checkpoint(tmp_path / "ckpt", ALTERNATING)
    lines = [{"id": "bad", "messages": CONVERSATIONS["system then user"]}]
    with pytest.raises(ValueError, match=r"workload\.jsonl: request 'bad': messages: .*alternate"):
        intake(tmp_path, lines, path=str(root))


def test_a_clients_chat_becomes_the_ids_transformers_gives_with_the_stop_ids(
    tmp_path: Path,
) -> None:
    root = write_checkpoint(tmp_path / "ckpt", LLAMA3, generation_config={"eos_token_id": [1]})
    made = Intake(Config(model=ModelConfig(path=str(root))))
    messages = CONVERSATIONS["user and assistant"]
    submit = Submit(request_id="c", messages=tuple(messages), params=SamplingParams(max_tokens=3))
    request = made.submitted(submit, "client-0/c", 0.0)
    expected = reference(root).apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False
    )
    assert list(request.prompt_token_ids) == expected
    assert request.params.stop_token_ids == (made.tokenizer().eos, 1)


def test_a_clients_chat_to_a_preset_or_a_refusing_template_is_a_request_error(
    tmp_path: Path,
) -> None:
    submit = Submit(request_id="c", messages=tuple(CONVERSATIONS["system then user"]))
    with pytest.raises(RequestError, match=r"messages: model\.preset 'tiny' has no chat template"):
        Intake(Config()).submitted(submit, "client-0/c", 0.0)
    root = write_checkpoint(tmp_path / "ckpt", ALTERNATING)
    with pytest.raises(RequestError, match=r"messages: .*roles must alternate") as caught:
        Intake(Config(model=ModelConfig(path=str(root)))).submitted(submit, "client-0/c", 0.0)
    assert caught.value.field == "messages"
