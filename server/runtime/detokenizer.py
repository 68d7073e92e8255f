"""Incremental detokenization with stop strings.

Text is released only when it is final: never half of a UTF-8 character (a decoded tail
ending in U+FFFD waits for the next token), and never text that could be the start of a
stop string (it waits until it is either completed, and cut off, or ruled out).
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens decoded along with the output, so a word-initial space survives


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], include_stop_str: bool,
                 min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = stop
        self.min_tokens = min_tokens  # stop strings count only in the text of later tokens (vLLM's min_tokens)
        self.tokens = 0
        self.include_stop_str = include_stop_str
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        # ids[prefix:read] were decoded already; their text is the baseline the next diff is taken against.
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # output text decoded so far, complete characters only
        self.released = 0  # characters of self.text handed to the client
        self.stopped = False

    def add_token(self, token_id: int) -> str:
        """Feed one generated token; return the text that became final. Sets ``stopped``."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        self.tokens += 1
        baseline = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        decoded = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(decoded) > len(baseline) and not decoded.endswith(REPLACEMENT_CHAR):
            self.text += decoded[len(baseline) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release()

    def finish(self) -> str:
        """The sequence ended for another reason (length, eos): release everything held back."""
        if self.stopped:
            return ""
        baseline = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        decoded = self.tokenizer.decode(self.ids[self.prefix_offset :])
        # A character cut off by the end (max_tokens) is dropped, as vLLM does, rather than sent as U+FFFD;
        # its bytes stay in the logprobs' `bytes`.
        self.text += decoded[len(baseline) :].rstrip(REPLACEMENT_CHAR)
        out = self.text[self.released :]
        self.released = len(self.text)
        return out

    def _release(self) -> str:
        pending = self.text[self.released :]
        if self.tokens < self.min_tokens:  # no stop string yet: nothing to hold back
            self.released = len(self.text)
            return pending
        stop_at = self._find_stop(pending)
        if stop_at is not None:
            index, stop = stop_at
            self.stopped = True
            end = index + len(stop) if self.include_stop_str else index
            self.released = len(self.text)
            return pending[:end]
        keep = len(pending) - self._held_back(pending)
        self.released += keep
        return pending[:keep]

    def _find_stop(self, pending: str) -> tuple[int, str] | None:
        # Held-back text guarantees a stop string cannot start before the released mark.
        hits = [(pending.find(s), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        return min(hits, default=None, key=lambda hit: hit[0])

    def _held_back(self, pending: str) -> int:
        """Length of the longest tail of ``pending`` that a stop string starts with."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest
