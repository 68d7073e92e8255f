"""POST /v1/completions (the legacy text API): several prompts, token-id prompts, echo."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from server.api.async_engine import SequenceGroup
from server.api.logprobs import CompletionLogprobs
from server.api.protocol import CompletionRequest
from server.api.serving import ServingContext, failed, usage
from server.api.streaming import SSE_DONE, SequenceStreamingResponse, sse, until_disconnect

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


def tokenize_prompts(ctx: ServingContext, body: CompletionRequest) -> list[tuple[str | list[int], list[int]]]:
    """(prompt as sent, token ids) of each prompt; the engine checks ids against the vocabulary."""
    prompts = body.prompts()
    params = ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]
    return [(p, ctx.encode(p, param) if isinstance(p, str) else list(p)) for p, param in zip(prompts, params)]


class _Choice:
    """One prompt x one of its n samples; index = prompt_index * n + sample."""

    def __init__(self, ctx: ServingContext, body: CompletionRequest, prompt: tuple[str | list[int], list[int]]):
        self._ctx = ctx
        self.prompt, self.prompt_ids = prompt
        self.echo_pending = body.echo
        self.logprobs = CompletionLogprobs(ctx) if body.logprobs is not None else None

    def delta(self, output) -> tuple[str, dict | None]:
        """Text and logprobs this output adds (the echoed prompt ahead of the first)."""
        echo, self.echo_pending = self.echo_pending, False
        text = output.text
        if echo:
            prompt = self.prompt
            text = (prompt if isinstance(prompt, str) else self._ctx.tokenizer.decode(prompt)) + text
        if self.logprobs is None:
            return text, None
        prompt_ids = self.prompt_ids if echo else None
        return text, self.logprobs.chunk(prompt_ids, output.prompt_logprobs if echo else None, output.logprobs)


async def create_completion(ctx: ServingContext, request: Request, body: CompletionRequest):
    ctx.check_model(body.model)
    prompts = await run_in_threadpool(tokenize_prompts, ctx, body)
    sequences = []
    for _, ids in prompts:
        max_tokens = ctx.max_tokens(body.max_tokens, len(ids), default=DEFAULT_MAX_TOKENS)
        for sample in range(body.n):
            params = body.sampling_params(max_tokens, body.logprobs, sample)
            params.prompt_logprobs = body.echo and body.logprobs is not None
            sequences.append((ids, params))
    request_id, group = ctx.start("cmpl", sequences, prompt_param="prompt",
                                  count_param="n" if body.n > 1 else "prompt")
    choices = [_Choice(ctx, body, prompt) for prompt in prompts for _ in range(body.n)]
    header = {"id": request_id, "object": "text_completion", "created": int(time.time()),
              "model": ctx.model_name, "system_fingerprint": ctx.system_fingerprint}
    if body.stream:
        return SequenceStreamingResponse(_stream(body, group, header, choices), group)
    return JSONResponse(await until_disconnect(request, group, _collect(body, group, header, choices)))


def _merge_logprobs(total: dict | None, part: dict | None) -> dict | None:
    if part is None:
        return total
    if total is None:
        return part
    return {key: total[key] + part[key] for key in total}


def _prompt_tokens(choices: list[_Choice], n: int) -> int:
    return sum(len(choices[i].prompt_ids) for i in range(0, len(choices), n))  # each prompt once, not n times


async def _collect(body: CompletionRequest, group: SequenceGroup, header: dict, choices: list[_Choice]) -> dict:
    results = [{"index": i, "text": "", "logprobs": None, "finish_reason": None} for i in range(len(choices))]
    completion_tokens = 0
    async for index, output in group.outputs():
        text, logprobs = choices[index].delta(output)
        results[index]["text"] += text
        results[index]["logprobs"] = _merge_logprobs(results[index]["logprobs"], logprobs)
        if output.finished:
            if error := failed(output):
                raise error
            results[index]["finish_reason"] = output.finish_reason
            completion_tokens += output.num_generated_tokens
    return {**header, "choices": results, "usage": usage(_prompt_tokens(choices, body.n), completion_tokens)}


async def _stream(body: CompletionRequest, group: SequenceGroup, header: dict, choices: list[_Choice]):
    completion_tokens = 0
    async for index, output in group.outputs():
        if output.finished and (error := failed(output)):
            yield sse(error.body())
            break
        text, logprobs = choices[index].delta(output)
        if text or logprobs or output.finished:
            payload = {**header, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                              "finish_reason": output.finish_reason if output.finished else None}]}
            if body.include_usage:
                payload["usage"] = None
            yield sse(payload)
        if output.finished:
            completion_tokens += output.num_generated_tokens
    else:
        if body.include_usage:
            yield sse({**header, "choices": [], "usage": usage(_prompt_tokens(choices, body.n), completion_tokens)})
    yield SSE_DONE
