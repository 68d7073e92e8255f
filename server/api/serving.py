"""What every endpoint shares: the engine, the served name, submission and token text."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from server.api.async_engine import SequenceGroup
from server.api.errors import ApiError
from server.runtime.engine import EngineNotRunning, EngineOverloaded, RequestRejected
from server.runtime.sequence import SamplingParams

RETRY_AFTER_S = 1


@dataclass
class ServingContext:
    engine: object  # server.runtime.engine.Engine (or anything with its interface)
    model_name: str
    system_fingerprint: str
    max_body_bytes: int
    created: int = field(default_factory=lambda: int(time.time()))
    _tokens: dict[int, tuple[str, bytes]] = field(default_factory=dict, repr=False)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise ApiError(404, f"The model '{requested}' does not exist; this server serves '{self.model_name}'.",
                           param="model", code="model_not_found")

    def max_tokens(self, requested: int | None, prompt_len: int, default: int | None) -> int:
        """The client's value, else `default`, else (as vLLM) whatever context the prompt leaves."""
        if requested is not None:
            return requested
        room = max(1, self.max_model_len - prompt_len)
        return room if default is None else min(default, room)

    def start(self, prefix: str, sequences: list[tuple[list[int], SamplingParams]],
              prompt_param: str, count_param: str) -> tuple[str, SequenceGroup]:
        """Submit a request's sequences; engine refusals become 400 (naming the field) or 503.
        `count_param` is the field that multiplied the sequences (n, or prompt for several prompts)."""
        queue = self.engine.config.max_queue
        if len(sequences) > queue:  # would be refused as "overloaded" however idle the server is
            raise ApiError(400, f"This request asks for {len(sequences)} sequences (prompts x n) but the server "
                           f"queues at most {queue} (--max-queue); send fewer prompts or a smaller n.",
                           param=count_param, code="invalid_value")
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        group = SequenceGroup(self.engine, request_id)
        try:
            group.submit(sequences)
        except RequestRejected as exc:
            param = exc.param if exc.param not in (None, "prompt", "prompt_token_ids") else prompt_param
            raise ApiError(400, str(exc), param=param, code=exc.code or "invalid_value") from exc
        except EngineOverloaded as exc:
            raise ApiError(503, f"The server is overloaded ({exc}); retry after {RETRY_AFTER_S} s.",
                           type="overloaded_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineNotRunning:  # checked under the engine's lock, so a request racing shutdown lands here
            raise ApiError(503, "The engine loop is not running; the server cannot take requests.",
                           type="overloaded_error", code="engine_unavailable") from None
        return request_id, group

    def token(self, token_id: int) -> tuple[str, bytes]:
        """One token's text and exact bytes, for logprobs (the text of a token holding part of a
        UTF-8 character shows U+FFFD; its bytes are exact)."""
        if token_id not in self._tokens:
            self._tokens[token_id] = (self.tokenizer.decode([token_id], skip_special_tokens=False),
                                      self.tokenizer.token_bytes(token_id))
        return self._tokens[token_id]

    def encode(self, text: str, param: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        if not ids:
            raise ApiError(400, f"'{param}' is empty after tokenization; send some text.", param=param,
                           code="invalid_value")
        return ids


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def failed(output) -> ApiError | None:
    """A sequence the engine could not finish, as the error the client gets (500: not their fault)."""
    if output.finish_reason == "error":
        return ApiError(500, f"The engine failed this request: {output.error}", type="internal_error",
                        code="engine_error")
    if output.finish_reason == "abort":
        return ApiError(503, "The request was aborted before it finished (the server is shutting down?).",
                        type="overloaded_error", code="aborted")
    return None
