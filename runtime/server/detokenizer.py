"""IncrementalDetokenizer: token ids in, text deltas out, never half a character.

Each push decodes a small window (a few tokens of left context + the new ones) and emits only
text that is final: nothing ending in U+FFFD (an incomplete UTF-8 sequence: emoji, CJK split
across byte-level tokens), and, when the request has stop strings, nothing within the last
`len(longest stop) - 1` characters (they could be the start of a stop string the scheduler will
match later; the final text is cut before the matched stop string, as Engine.generate does).
`finish` (with the last tokens) returns the rest, so the concatenated deltas equal the non-streamed text.
"""

from __future__ import annotations

from typing import Any

from runtime.messages import FinishReason
from runtime.result import cut_at_stop

_CONTEXT_TOKENS = 6  # left context so that a token's leading space / merge decodes correctly


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] is context already decoded
        self.read_offset = 0
        self.text = ""  # all decoded text that is final so far (emitted or held back)
        self.emitted = 0  # chars of self.text handed out

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the text delta that is safe to send now (maybe '')."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd") and full.startswith(prefix):
            self.text += full[len(prefix) :]
            self.read_offset = len(self.ids)
            self.prefix_offset = max(0, self.read_offset - _CONTEXT_TOKENS)
        return self._take(len(self.text) - self.holdback)

    def prime(self, ids: list[int], sent_chars: int) -> None:
        """Take `ids` as already decoded, of whose text the client has the first `sent_chars`
        characters (a resumed stream): the next delta starts right after them."""
        self.push(ids)
        self.emitted = sent_chars

    def finish(self, new_ids: list[int], reason: FinishReason | None = None) -> str:
        """The request ended with `new_ids` (and `reason`): return everything not yet sent, cut
        before the stop string it matched."""
        self.ids.extend(new_ids)
        final = cut_at_stop(self._decode(self.ids), reason)
        if final.startswith(self.text[: self.emitted]):
            self.text = final
        else:  # a tokenizer whose windows do not concatenate: fall back to the tail we can send
            self.text = self.text[: self.emitted] + final[self.emitted :]
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta
