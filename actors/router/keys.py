"""A prompt's block keys as the instances hash them, for the policies that read them.

Token ids as the client gave them; text and chats through an instance's ``/tokenize``
(which renders a chat with the instance's own template); then hashed into block keys as
the engine hashes them (``cache/block_hash.py``, in the instances' namespace, which the
pool's fingerprint check makes the same for all), salted with the body's ``cache_salt`` as
the instance salts it. A prompt that cannot be tokenized has no keys: it is routed by load
alone, and the instance it reaches names what is wrong with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from ringfence.actors.router.instances import Identity, Instance
from ringfence.actors.router.upstream import TransportError, Upstream
from ringfence.cache.block_hash import block_keys
from ringfence.cache.ids import BlockHash

TOKENIZE_S = 5.0  # one /tokenize call


def keys_of(identity: Identity, tokens: Sequence[int], salt: str = "") -> list[BlockHash]:
    """The block keys of ``tokens`` salted with ``salt`` on instances of ``identity`` (none
    without a namespace)."""
    if not identity.namespace or identity.block_size <= 0 or not tokens:
        return []
    namespace = bytes.fromhex(identity.namespace)
    return block_keys(list(tokens), identity.block_size, namespace=namespace, salt=salt)


def salt_of(request: dict[str, Any]) -> str:
    """The cache salt of a client's request ("" for none, or one the instance will refuse)."""
    salt = request.get("cache_salt")
    return salt if isinstance(salt, str) else ""


async def prompt_keys(
    client: Upstream, kind: str, request: dict[str, Any], up: Sequence[Instance]
) -> list[BlockHash]:
    """The keys of the prompt of ``request`` (a ``completions`` or ``chat`` body, parsed),
    tokenized where needed by the least busy of ``up`` (the instances not known to be down)."""
    if not up:
        return []
    tokens = await prompt_tokens(client, kind, request, min(up, key=lambda i: i.in_flight))
    return keys_of(up[0].identity, tokens, salt_of(request))


async def prompt_tokens(
    client: Upstream, kind: str, request: dict[str, Any], instance: Instance
) -> list[int]:
    """The token ids of the prompt of ``request`` (the client's body)."""
    ask: dict[str, Any]
    if kind == "chat":
        if not isinstance(request.get("messages"), list):
            return []
        ask = {"messages": request["messages"]}
    else:
        prompt = request.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
            prompt = prompt[0]  # several prompts: the first one's prefix decides
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if not isinstance(prompt, str):
            return []
        ask = {"prompt": prompt}
    try:
        answer = await client.post(
            f"{instance.url}/tokenize", orjson.dumps(ask), timeout=TOKENIZE_S
        )
    except TransportError:
        return []
    if answer.status != 200:
        return []
    try:
        tokens = answer.json().get("tokens")
    except ValueError:
        return []
    return tokens if isinstance(tokens, list) else []
