"""Byte-level BPE tokenizer (GPT-2 style) built from GGUF `tokenizer.ggml.*` metadata.

Encoding, as SmolLM2's tokenizer.json does it:
1. split out special tokens (GGUF token types CONTROL and USER_DEFINED) as whole tokens;
2. pre-tokenize: every numeric character becomes its own piece (`Digits(individual_digits)`),
   then each piece is cut with the GPT-2 regex (contractions, letters, numbers, other, spaces);
3. map each piece's UTF-8 bytes to printable characters (`_bytes_to_unicode`) and apply the
   merges in rank order.
Python's `re` has no \\p{L} / \\p{N}; the classes are built once from `unicodedata`.
"""

from __future__ import annotations

import functools
import re
import sys
import unicodedata

from kvstore.errors import InvalidArgument

from .gguf_loader import TokenizerData

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
SUPPORTED_PRE = ("smollm", "gpt2", "default")

DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def _category_class(prefix: str) -> str:
    """A regex character class body matching every code point whose category starts with prefix."""
    ranges, start = [], None
    for cp in range(sys.maxunicode + 2):
        inside = cp <= sys.maxunicode and unicodedata.category(chr(cp)).startswith(prefix)
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            ranges.append(f"{re.escape(chr(start))}-{re.escape(chr(cp - 1))}")
            start = None
    return "".join(ranges)


@functools.cache
def _pretokenizer_patterns() -> tuple[re.Pattern, re.Pattern]:
    letters, numbers = _category_class("L"), _category_class("N")
    digit = re.compile(f"([{numbers}])")
    gpt2 = re.compile(
        rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{numbers}]+| ?[^\s{letters}{numbers}]+"
        r"|\s+(?!\S)|\s+")
    return digit, gpt2


class Tokenizer:
    """Encode text to token ids and back. Immutable after construction; safe to share."""

    def __init__(self, data: TokenizerData):
        if data.pre not in SUPPORTED_PRE:
            raise InvalidArgument(f"pre-tokenizer {data.pre!r} is not supported "
                                  f"(supported: {', '.join(SUPPORTED_PRE)})")
        self.bos_id, self.eos_id = data.bos_id, data.eos_id
        self.vocab = {tok: i for i, tok in enumerate(data.tokens)}
        self.tokens = list(data.tokens)
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(data.merges)}
        self.special_ids = {i for i, t in enumerate(data.token_types)
                            if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)}
        specials = sorted((self.tokens[i] for i in self.special_ids), key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, specials)) + ")")
        self._byte_encoder = _bytes_to_unicode()
        self._byte_decoder = {c: b for b, c in self._byte_encoder.items()}
        self._digit_re, self._word_re = _pretokenizer_patterns()
        self._bpe_cache: dict[str, tuple[int, ...]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def token_id(self, token: str) -> int:
        return self.vocab[token]

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids for text. With allow_special, '<|im_start|>' etc. become their single ids."""
        ids: list[int] = []
        pieces = self._special_re.split(text) if allow_special else [text]
        for i, piece in enumerate(pieces):
            if allow_special and i % 2 == 1:
                ids.append(self.vocab[piece])
                continue
            for part in self._digit_re.split(piece):
                for word in self._word_re.findall(part):
                    ids.extend(self._bpe(word))
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        out = bytearray()
        for i in ids:
            if i < 0 or i >= len(self.tokens):
                raise InvalidArgument(f"token id {i} outside the vocabulary [0, {len(self.tokens)})")
            if i in self.special_ids:
                if not skip_special:
                    out += self.tokens[i].encode("utf-8")
            else:
                out += bytes(self._byte_decoder[c] for c in self.tokens[i])
        return out.decode("utf-8", errors="replace")

    def _bpe(self, word: str) -> tuple[int, ...]:
        cached = self._bpe_cache.get(word)
        if cached is not None:
            return cached
        parts = [self._byte_encoder[b] for b in word.encode("utf-8")]
        while len(parts) > 1:
            rank, best = min((self.ranks.get(pair, sys.maxsize), pair)
                             for pair in zip(parts, parts[1:]))
            if rank == sys.maxsize:
                break
            merged, i = [], 0
            while i < len(parts):    # merge every occurrence of the best pair, left to right
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        ids = tuple(self.vocab[p] for p in parts)
        if len(self._bpe_cache) < 100_000:
            self._bpe_cache[word] = ids
        return ids

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> list[int]:
        """SmolLM2-Instruct's ChatML template (with its default system prompt), as token ids."""
        if messages and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, *messages]
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text)
