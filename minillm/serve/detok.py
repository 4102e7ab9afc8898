"""Incremental detokenization for streaming: token ids in, text pieces out.

Byte-level BPE tokens are byte strings, and one character may be split across tokens (an
emoji is 4 bytes, often 2-3 tokens). Decoding each token alone would show U+FFFD for the
halves. So the bytes go through an incremental UTF-8 decoder that holds back an incomplete
trailing sequence until the bytes that complete it arrive.

Stop strings: text that might be the start of a stop string is held back too (at most the
longest stop string minus one character), so a stop string never reaches the client. When
one appears, the text is cut just before it and `stopped` becomes True.

Invariants:
- "".join(every piece from `push`, then `flush`) == `text`, the non-streamed text: the
  server builds both from this one object.
- `text` equals `tokenizer.decode(ids, skip_special_tokens=True)` (cut at the first stop
  string), and a piece never contains U+FFFD unless `text` has one at that place (bytes
  that no continuation can complete).
"""
from __future__ import annotations

import codecs
from collections.abc import Iterable


class TokenTable:
    """The bytes of every token id, computed once per tokenizer; special tokens (chat
    markers, EOS) decode to nothing, as with skip_special_tokens=True."""

    def __init__(self, tokenizer):
        special = set(tokenizer.special_tokens.values())
        self.bytes = [b"" if i in special else b for i, b in enumerate(tokenizer.token_bytes())]

    def detokenizer(self, stop: Iterable[str] = ()) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self.bytes, stop)


class IncrementalDetokenizer:
    def __init__(self, token_bytes: list[bytes], stop: Iterable[str] = ()):
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = tuple(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""        # everything decoded so far (cut at a stop string)
        self.num_emitted = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string was found: generation should end

    def push(self, token_ids: Iterable[int]) -> str:
        """Add tokens; return the text that is now final (may be "")."""
        if self.stopped:
            return ""
        data = b"".join(self._token_bytes[t] for t in token_ids)
        start = max(self.num_emitted - self._hold, 0)  # where a new stop string could begin
        self.text += self._utf8.decode(data)
        if self.stop:
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True
                return self._emit(len(self.text))
        return self._emit(len(self.text) - self._hold)

    def flush(self) -> str:
        """Generation ended: decode what is held back (an incomplete character becomes
        U+FFFD, as in the full decode) and return the rest of the text."""
        if not self.stopped:
            self.text += self._utf8.decode(b"", final=True)
            if self.stop:  # a stop string completed by the flushed characters
                hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
                if hits:
                    self.text, self.stopped = self.text[:min(hits)], True
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.num_emitted:
            return ""
        piece = self.text[self.num_emitted:upto]
        self.num_emitted = upto
        return piece
