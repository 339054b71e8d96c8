"""Incremental detokenization and stop strings for one streamed choice.

Decoding token by token breaks multi-byte characters and SentencePiece leading spaces, so each new
text piece is the difference between decoding a short window of recent ids with and without the new
ids (the vLLM scheme); a trailing U+FFFD means "incomplete character, wait for the next token". The
window starts inside the prompt so the first generated word keeps its leading space.

Stop strings are searched in the decoded text; the text is cut before the first match. While
streaming, the last `max(len(stop)) - 1` characters are held back, so a stop string that arrives split
over several tokens is never sent to the client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_CONTEXT = 6  # prompt ids kept as decoding context


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: Sequence[int], stop: Sequence[str]):
        self._decode = decode
        self._ids = list(prompt_ids[-_CONTEXT:])
        self._prefix = 0  # window start
        self._read = len(self._ids)  # ids already turned into text
        self.stop = tuple(stop)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all text so far (cut at a stop string once one matched)
        self.sent = 0  # characters of `text` already handed out by `take`
        self.stopped = False  # a stop string matched

    def add(self, new_ids: Sequence[int], final: bool = False) -> None:
        """Append generated ids; updates `text` and `stopped`. `final` flushes an incomplete character."""
        if self.stopped:
            return
        self._ids.extend(int(t) for t in new_ids)
        if self._read == len(self._ids):
            return
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if after.endswith("\ufffd") and not final:
            return
        if after.startswith(before):
            piece = after[len(before):]
        else:  # the tokenizer re-merged across the boundary; fall back to the common prefix
            common = 0
            while common < min(len(before), len(after)) and before[common] == after[common]:
                common += 1
            piece = after[common:]
        self._prefix, self._read = self._read, len(self._ids)
        self._append(piece)

    def _append(self, piece: str) -> None:
        start = max(0, len(self.text) - self._holdback)
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def visible(self, final: bool) -> str:
        """All text so far, less a tail that may still grow into a stop string unless `final`."""
        if final or self.stopped:
            return self.text
        return self.text[:max(0, len(self.text) - self._holdback)]

    def take(self, final: bool) -> str:
        """Text not yet handed out; keeps a possible stop-string prefix back unless `final`."""
        end = len(self.text) if (final or self.stopped) else max(self.sent, len(self.text) - self._holdback)
        out = self.text[self.sent:end]
        self.sent = end
        return out
