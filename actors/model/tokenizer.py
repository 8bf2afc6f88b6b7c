"""A byte-level tokenizer for the model presets: ids 0..255 are bytes, then bos, eos, pad."""

from __future__ import annotations

from collections.abc import Iterable

NUM_BYTES = 256
BOS = 256  # start of a sequence
EOS = 257  # end of a sequence: generation stops here
PAD = 258  # filler; never produced by encode
VOCAB_SIZE = 259  # bytes + specials; the "tiny" preset's vocab_size


class ByteTokenizer:
    """UTF-8 bytes as token ids. Stateless; safe to share between threads."""

    bos = BOS
    eos = EOS
    pad = PAD
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids, after ``BOS`` when asked for."""
        ids = list(text.encode("utf-8"))
        return [BOS, *ids] if bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte ids; special ids (and any id past them) are skipped.

        Bytes that are not valid UTF-8 (e.g. a sequence cut mid-character) decode as U+FFFD.
        """
        data = bytearray()
        for token in ids:
            if token < 0:
                raise ValueError(f"token id {token} is negative")
            if token < NUM_BYTES:
                data.append(token)
        return data.decode("utf-8", errors="replace")
