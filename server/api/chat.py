"""POST /v1/chat/completions."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from server.api.async_engine import SequenceGroup
from server.api.errors import ApiError
from server.api.logprobs import chat_logprobs
from server.api.protocol import ChatCompletionRequest
from server.api.serving import ServingContext, failed, usage
from server.api.streaming import SSE_DONE, SequenceStreamingResponse, sse, until_disconnect


def render_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=not body.continue_final_message)
    except ValueError as exc:  # no template, or the template's raise_exception("roles must alternate")
        raise ApiError(400, f"Cannot render these messages: {exc}", param="messages",
                       code="invalid_value") from None
    if body.continue_final_message:  # cut the end-of-turn the template wrote after the final message
        final = messages[-1]["content"]
        start = text.rfind(final)
        if start < 0:
            raise ApiError(400, "The chat template rewrites the final assistant message (trims it?), so the reply "
                           "cannot continue it; send it as the template writes it.",
                           param="continue_final_message", code="invalid_value")
        text = text[: start + len(final)]
    return ctx.encode(text, "messages")


async def create_chat_completion(ctx: ServingContext, request: Request, body: ChatCompletionRequest):
    ctx.check_model(body.model)
    prompt_ids = await run_in_threadpool(render_prompt, ctx, body)
    max_tokens = ctx.max_tokens(body.requested_max_tokens, len(prompt_ids), default=None)
    sequences = [(prompt_ids, body.sampling_params(max_tokens, body.engine_logprobs, i)) for i in range(body.n)]
    request_id, group = ctx.start("chatcmpl", sequences, prompt_param="messages", count_param="n")
    header = {"id": request_id, "created": int(time.time()), "model": ctx.model_name,
              "system_fingerprint": ctx.system_fingerprint}
    if body.stream:
        return SequenceStreamingResponse(_stream(ctx, body, group, header), group)
    return JSONResponse(await until_disconnect(request, group, _collect(ctx, body, group, header)))


async def _collect(ctx: ServingContext, body: ChatCompletionRequest, group: SequenceGroup, header: dict) -> dict:
    texts = [[] for _ in range(body.n)]
    logprobs = [[] for _ in range(body.n)]
    choices: list[dict] = [{} for _ in range(body.n)]
    prompt_tokens = completion_tokens = 0
    async for index, output in group.outputs():
        texts[index].append(output.text)
        logprobs[index].extend(output.logprobs or [])
        if output.finished:
            if error := failed(output):
                raise error
            prompt_tokens = output.num_prompt_tokens
            completion_tokens += output.num_generated_tokens
            choices[index] = {
                "index": index,
                "message": {"role": "assistant", "content": "".join(texts[index])},
                "logprobs": chat_logprobs(ctx, logprobs[index] if body.logprobs else None),
                "finish_reason": output.finish_reason}
    return {**header, "object": "chat.completion", "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}


async def _stream(ctx: ServingContext, body: ChatCompletionRequest, group: SequenceGroup, header: dict):
    def chunk(choices: list[dict], usage_=None) -> str:
        payload = {**header, "object": "chat.completion.chunk", "choices": choices}
        if body.include_usage:  # OpenAI: null on every chunk but the last, which has no choices
            payload["usage"] = usage_
        return sse(payload)

    # The role comes first, in a delta of its own (as OpenAI sends it).
    for index in range(body.n):
        yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    prompt_tokens = completion_tokens = 0
    async for index, output in group.outputs():
        if output.finished and (error := failed(output)):
            yield sse(error.body())
            break
        if output.text or output.logprobs or output.finished:
            yield chunk([{"index": index, "delta": {"content": output.text} if output.text else {},
                          "logprobs": chat_logprobs(ctx, output.logprobs if body.logprobs else None),
                          "finish_reason": output.finish_reason if output.finished else None}])
        if output.finished:
            prompt_tokens = output.num_prompt_tokens
            completion_tokens += output.num_generated_tokens
    else:
        if body.include_usage:
            yield chunk([], usage(prompt_tokens, completion_tokens))
    yield SSE_DONE
