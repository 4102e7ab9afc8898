"""The model's tokenizer, rebuilt from GGUF metadata with the `tokenizers` library.

SmolLM2 uses byte-level BPE (GPT-2 style): text is split by a pre-tokenizer, each piece is
mapped to printable byte symbols (a space becomes `Ġ`), then merges are applied. Its
pre-tokenizer first isolates every digit, then applies the GPT-2 split regex.

Invariants:
- Control tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, ...) are added as special
  tokens, so each encodes to one id instead of being split into pieces.
- `decode(encode(s)) == s` for any string (byte-level BPE is lossless).
"""
from __future__ import annotations

from typing import Iterable, Sequence

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

# GGUF token types (gguf.TokenType): 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte.
_SPECIAL_TOKEN_TYPES = (3, 4)

DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE's alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class MiniTokenizer:
    """encode/decode plus the ChatML chat template the model was trained with."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                 bos_token_id: int | None, eos_token_id: int | None,
                 default_system_prompt: str | None = DEFAULT_SYSTEM_PROMPT):
        vocab = {tok: i for i, tok in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
        tk = Tokenizer(bpe)
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        tk.decoder = decoders.ByteLevel()
        specials = [tokens[i] for i, t in enumerate(token_types) if t in _SPECIAL_TOKEN_TYPES]
        tk.add_special_tokens(specials)
        self._tk = tk
        self.vocab_size = len(tokens)
        self.special_tokens = {s: vocab[s] for s in specials}
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.default_system_prompt = default_system_prompt
        self.im_start_id = self.special_tokens.get("<|im_start|>")
        self.im_end_id = self.special_tokens.get("<|im_end|>")

    @classmethod
    def from_gguf_reader(cls, reader) -> "MiniTokenizer":
        def field(key):
            f = reader.fields.get(key)
            return None if f is None else f.contents()
        model = field("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, "
                             f"got {model!r}")
        return cls(field("tokenizer.ggml.tokens"), field("tokenizer.ggml.merges"),
                   field("tokenizer.ggml.token_type"), field("tokenizer.ggml.bos_token_id"),
                   field("tokenizer.ggml.eos_token_id"))

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def token_bytes(self) -> list[bytes]:
        """The UTF-8 bytes each token id stands for (a special token: its own text).
        A token may hold part of a character: decoding must join bytes, not strings."""
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        special = set(self.special_tokens.values())
        out = []
        for i in range(self.vocab_size):
            token = self._tk.id_to_token(i)
            out.append(token.encode() if i in special else bytes(byte_of[c] for c in token))
        return out

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True):
        """ChatML, exactly as the model's own template renders it:

            <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{text}<|im_end|>\\n
            <|im_start|>assistant\\n

        A default system message is inserted when the first message is not a system one.
        """
        parts = []
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', "
                                 f"got {msg!r}")
            if i == 0 and msg["role"] != "system" and self.default_system_prompt is not None:
                parts.append(f"<|im_start|>system\n{self.default_system_prompt}<|im_end|>\n")
            parts.append(f"<|im_start|>{msg['role']}\n{msg['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        text = "".join(parts)
        return self.encode(text) if tokenize else text
