"""Text of a growing list of generated tokens, decoded incrementally, with stop strings.

Each update decodes a short window: the tokens not yet turned into text plus the ones decoded
just before them, whose text is subtracted. The earlier tokens give the tokenizer its context
(a piece's leading space, a character split over several byte tokens), so the window's text
beyond theirs is exactly what the new tokens add; a request of n tokens costs O(n) decoding,
not O(n^2). Text ending in an incomplete UTF-8 sequence waits for the next token.

Stop strings are never streamed in part: text that could be the beginning of a stop string is
held back until the next tokens show whether it is one, and handed out by
:meth:`Detokenizer.finish` when the request ends without one.
"""

from __future__ import annotations

from shardline.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"  # what decoding gives for a cut UTF-8 sequence


class Detokenizer:
    """Streams the text of one request's generated tokens (``tokenizer`` None: no text)."""

    def __init__(self, tokenizer: Tokenizer | None, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.text = ""  # handed out so far
        self._decoded = ""  # all text decoded so far, held-back part included
        self._context = 0  # first token of the next window (already decoded)
        self._read = 0  # tokens whose text is in _decoded
        self._stopped = False

    @property
    def num_tokens_read(self) -> int:
        """How many of the tokens are in the decoded text (after a stop: up to the token
        that completed the stop string)."""
        return self._read

    def update(self, token_ids: list[int]) -> tuple[str, bool]:
        """The new text since the last call, and whether a stop string was reached (the text
        ends before it; later calls add nothing)."""
        if self.tokenizer is None or self._stopped or len(token_ids) <= self._read:
            return "", self._stopped
        new = self._new_text(token_ids)
        if not new or new.endswith(_INCOMPLETE):
            return "", False  # tokens without text (yet), or an unfinished character
        self._take(new, token_ids)
        return self._hand_out()

    def finish(self, token_ids: list[int]) -> str:
        """The rest of the text once the request has ended: what was held back as a possible
        stop string's beginning or as an unfinished character (then decoded as it is)."""
        if self._stopped:
            return ""
        if self.tokenizer is not None and len(token_ids) > self._read:
            self._take(self._new_text(token_ids), token_ids)
        rest = self._decoded[len(self.text) :]
        self.text = self._decoded
        return rest

    def _new_text(self, token_ids: list[int]) -> str:
        """What the tokens after the last read one add: the window's text beyond the text of
        its context tokens."""
        known = self.tokenizer.decode(token_ids[self._context : self._read])
        return self.tokenizer.decode(token_ids[self._context :])[len(known) :]

    def _take(self, new: str, token_ids: list[int]) -> None:
        """Add ``new`` (the text of ``token_ids`` beyond the last read token) to the decoded
        text; the tokens read so far become the next window's context."""
        self._decoded += new
        self._context, self._read = self._read, len(token_ids)

    def _hand_out(self) -> tuple[str, bool]:
        start = len(self.text)
        if not self.stop:
            self.text = self._decoded
            return self._decoded[start:], False
        # Handed-out text never ends in a stop string's beginning, so a stop string can only
        # start in the new part.
        hits = [i for i in (self._decoded.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self._stopped = True
            end = min(hits)
        else:
            end = len(self._decoded) - self._possible_stop_start(start)
        delta = self._decoded[start:end]
        self.text += delta
        return delta, self._stopped

    def _possible_stop_start(self, start: int) -> int:
        """Length of the longest ending of the not-yet-handed-out text that begins some stop
        string (and may turn into it)."""
        pending = self._decoded[start:]
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:length]):
                    longest = length
                    break
        return longest
