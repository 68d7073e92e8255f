"""Log-probabilities in OpenAI's two shapes: chat (`content` entries) and legacy completions."""

from __future__ import annotations

from server.api.serving import ServingContext


def _chat_entry(ctx: ServingContext, token_id: int, logprob: float) -> dict:
    text, raw = ctx.token(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(ctx: ServingContext, logprobs) -> dict | None:
    """`choices[i].logprobs` of a chat completion from engine TokenLogprobs (None: not asked)."""
    if logprobs is None:
        return None
    return {"content": [
        {**_chat_entry(ctx, lp.token_id, lp.logprob),
         "top_logprobs": [_chat_entry(ctx, tid, value) for tid, value in lp.top]}
        for lp in logprobs]}


class CompletionLogprobs:
    """Builds `choices[i].logprobs` of a completion (tokens, token_logprobs, top_logprobs,
    text_offset), token by token across streamed chunks; offsets count characters from the start
    of the choice's text (echoed prompt included)."""

    def __init__(self, ctx: ServingContext):
        self._ctx = ctx
        self._offset = 0

    def _add(self, result: dict, token_id: int, logprob: float | None, top: dict | None) -> None:
        text = self._ctx.token(token_id)[0]
        result["tokens"].append(text)
        result["token_logprobs"].append(logprob)
        result["top_logprobs"].append(top)
        result["text_offset"].append(self._offset)
        self._offset += len(text)

    def chunk(self, prompt_ids: list[int] | None, prompt_logprobs, logprobs) -> dict:
        """Entries for (echoed prompt tokens and) newly generated tokens."""
        result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, logprob in zip(prompt_ids or [], prompt_logprobs or []):
            self._add(result, token_id, logprob, None)  # the engine gives prompt tokens no alternatives
        for lp in logprobs or []:
            # OpenAI's legacy shape: a {token text: logprob} map that includes the sampled token.
            top = {self._ctx.token(lp.token_id)[0]: lp.logprob}
            top.update((self._ctx.token(tid)[0], value) for tid, value in lp.top)
            self._add(result, lp.token_id, lp.logprob, top)
        return result
