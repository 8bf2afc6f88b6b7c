"""KV events of ``ringfence serve`` (``events.enabled``): the instance advertises where it
publishes them on ``/v1/models``, so a router needs only its URL; a subscriber written
for vLLM replays the stream from there and finds every full block of a prompt it sent,
hashed as a router would hash it (the fingerprint of the model card as namespace)."""

from __future__ import annotations

import zmq
from vllm_events import DECODERS

from ringfence.actors.events.publisher import END_SEQ
from ringfence.cache.block_hash import block_keys

WAIT_MS = 10_000


def replay(endpoint: str) -> list[bytes]:
    """Every batch the instance kept, in order, from its replay socket."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        payloads: list[bytes] = []
        while True:
            assert dealer.poll(WAIT_MS), "the replay socket did not answer"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return payloads
            payloads.append(payload)
    finally:
        ctx.destroy(linger=0)


def test_the_model_card_says_where_to_subscribe_and_a_prompts_blocks_are_announced(
    tiny_server,
):
    card = tiny_server.get("/v1/models").json()["data"][0]["ringfence"]
    events = card["events"]
    assert events["endpoint"].startswith("tcp://127.0.0.1:")
    assert events["replay_endpoint"].startswith("tcp://127.0.0.1:")
    first = DECODERS["map"].decode(replay(events["replay_endpoint"])[0])
    assert type(first.events[0]).__name__ == "MapAllBlocksCleared"  # a new engine: all unknown
    size = card["block_size"]
    prompt = [(7 * i + 3) % 200 + 1 for i in range(3 * size + 2)]  # three full blocks
    answer = tiny_server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    stored = {
        bytes(h)
        for payload in replay(events["replay_endpoint"])
        for e in DECODERS["map"].decode(payload).events
        if type(e).__name__ == "MapBlockStored" and e.medium == "GPU"
        for h in e.block_hashes
    }
    keys = block_keys(prompt, size, namespace=bytes.fromhex(card["fingerprint"]))
    assert len(keys) == 3 and set(keys) <= stored
