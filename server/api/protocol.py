"""OpenAI request bodies (pydantic) and their translation into engine SamplingParams.

Strict types (a string where a number belongs is an error, as at OpenAI); unknown fields are
accepted and ignored, as OpenAI does; known features this server lacks (tools, JSON mode, logit
biases...) are refused, since ignoring them would return something other than what was asked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from server.api.errors import ApiError
from server.runtime.sequence import SamplingParams

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
# Every stop string (and stop token id) is searched for in every sequence after every token, on the engine
# thread that all requests share: 100k of them with n=64 held a 4-token request of someone else for 20 s.
# OpenAI allows 4.
MAX_STOP_STRINGS = 64
CHAT_ROLES = ("system", "user", "assistant")
# OpenAI's newer name for the system role ("developer messages replace system messages").
ROLE_ALIASES = {"developer": "system"}

# Features this server does not implement and whose silent omission would change the reply the client
# relies on (JSON mode, tool calls, biased tokens): refused with a 400, not ignored like unknown fields.
# name -> (whether the sent value asks for the feature, what the feature is)
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logit_bias": (bool, "logit biases"),
    "tools": (bool, "tool calling"),
    "functions": (bool, "function calling"),
    "tool_choice": (lambda v: v not in ("none", "auto"), "tool calling"),
    "function_call": (lambda v: v not in ("none", "auto"), "function calling"),
    "response_format": (lambda v: v != {"type": "text"}, "structured output (only {'type': 'text'})"),
    "suffix": (bool, "insertion after a suffix"),
    "modalities": (lambda v: v != ["text"], "output modalities other than text"),
    "audio": (lambda v: True, "audio output"),
    # vLLM's extensions of the same kind
    "guided_json": (bool, "structured output"),
    "guided_regex": (bool, "structured output"),
    "guided_choice": (bool, "structured output"),
    "guided_grammar": (bool, "structured output"),
}


def _invalid(param: str, message: str) -> ApiError:
    # Cross-field checks raise ApiError, which pydantic lets through, so the error names its field.
    return ApiError(400, message, param=param, code="invalid_value")


def _refuse_unsupported(body: dict) -> None:
    for name, (asks_for_it, feature) in UNSUPPORTED.items():
        if name in body and asks_for_it(body[name]):
            raise ApiError(400, f"'{name}' asks for {feature}, which this server does not support; remove it "
                           "from the request.", param=name, code="unsupported_parameter")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class ChatMessage(_Body):
    role: str
    content: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        role = ROLE_ALIASES.get(role, role)
        if role not in CHAT_ROLES:
            raise ValueError(f"unknown role; expected one of {', '.join(CHAT_ROLES)} (or developer)")
        return role

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        """OpenAI's list of text parts joins into one string (no union, so errors name `content`)."""
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
            raise ValueError("content must be a string or a list of {'type': 'text', 'text': ...} parts")
        for part in content:
            if part.get("type") != "text":
                raise ValueError(f"only text parts are supported, not {part.get('type')!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError("every text part needs a 'text' string")
        return "".join(part["text"] for part in content)

    def text(self) -> str:
        return self.content or ""


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """Fields shared by chat and completions requests."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0  # vLLM's extension
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0)] = 1.0
    best_of: Annotated[int, Field(ge=1)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_STRINGS)] = []  # vLLM's extension
    include_stop_str_in_output: bool = False  # vLLM's extension
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_and_unsupported(cls, body: Any) -> Any:
        if not isinstance(body, dict):
            return body
        # Many clients send `"temperature": null` for "not set"; every field's default is that.
        body = {k: v for k, v in body.items() if v is not None}
        _refuse_unsupported(body)
        return body

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop: Any) -> Any:
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if stop is not None and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}")
        return stop

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise _invalid("stream_options", "stream_options is only allowed when stream is true.")
        return self

    @model_validator(mode="after")
    def _best_of_is_n(self):
        # best_of > n would rank best_of samples by likelihood and return n; this server returns all it samples.
        if self.best_of is not None and self.best_of < self.n:
            raise _invalid("best_of", f"best_of ({self.best_of}) must be at least n ({self.n}).")
        if self.best_of is not None and self.best_of > self.n:
            raise ApiError(400, f"best_of={self.best_of} > n={self.n} is not supported; send n={self.best_of} "
                           "and pick among the choices yourself.", param="best_of", code="unsupported_parameter")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, logprobs: int | None, index: int) -> SamplingParams:
        """Params of the index-th of the n sequences (seed + index, so the n differ yet repeat)."""
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=None if self.seed is None else self.seed + index, stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids), include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, logprobs=logprobs)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # vLLM's extension: write the reply on from the final assistant message instead of starting a new turn.
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise _invalid("top_logprobs", "top_logprobs requires logprobs to be true.")
        return self

    @model_validator(mode="after")
    def _continue_an_assistant_message(self):
        final = self.messages[-1]
        if self.continue_final_message and (final.role != "assistant" or not final.text()):
            raise _invalid("continue_final_message", "continue_final_message needs the last message to be a "
                           "non-empty assistant message (the text the reply continues).")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        def is_ids(x):
            return isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        ok = (isinstance(prompt, str) or is_ids(prompt)
              or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt))
              or (isinstance(prompt, list) and prompt and all(is_ids(p) for p in prompt)))
        if not ok:
            raise ValueError("prompt must be a string, a non-empty list of strings, a non-empty list of "
                             "token ids, or a non-empty list of non-empty token-id lists")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)
