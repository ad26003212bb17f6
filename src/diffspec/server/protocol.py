"""OpenAI request validation and response shapes for `diffspec serve`.

Contract: `parse_chat` / `parse_completion` turn a decoded JSON body into a `GenerationRequest`
or raise `RequestError` (HTTP status + one-line message naming the parameter). Nothing is
silently ignored: a parameter that would change the output and is not implemented (`n` > 1,
`logprobs`, `tools`, penalties, `logit_bias`, `response_format` other than text, ...) is refused
unless it carries its neutral value (e.g. `n: 1`, `presence_penalty: 0`); an unknown parameter is
refused too. Only identifiers with no effect on the output (`user`, `metadata`, ...) are accepted
and not used. `null` means "not given" everywhere.

Defaults follow OpenAI: temperature 1, top_p 1, max tokens = the rest of the context for chat and
16 for /v1/completions. `top_k` is accepted as an extension (0 = off). A request whose prompt plus
an explicit max tokens exceeds the context is refused (400), as OpenAI does.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from ..errors import DiffspecError
from ..types import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# accepted, with no effect on the output
_INERT = {"user", "metadata", "safety_identifier", "prompt_cache_key", "service_tier"}
# not implemented: accepted only with these neutral values (None is always neutral)
_NEUTRAL_COMMON = {"n": (1,), "frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},)}
_NEUTRAL_CHAT = {**_NEUTRAL_COMMON, "logprobs": (False,), "top_logprobs": (0,), "tools": ([],),
                 "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
                 "parallel_tool_calls": (True, False), "response_format": ({"type": "text"},),
                 "modalities": (["text"],), "store": (False,), "audio": (), "prediction": (),
                 "reasoning_effort": (), "verbosity": (), "web_search_options": (), "moderation": (),
                 "prompt_cache_options": (), "prompt_cache_retention": ()}
_NEUTRAL_COMPLETION = {**_NEUTRAL_COMMON, "logprobs": (), "best_of": (1,), "echo": (False,), "suffix": ("",)}
_SUPPORTED_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                     "stream_options"}
_SUPPORTED_CHAT = _SUPPORTED_COMMON | {"messages", "max_completion_tokens"}
_SUPPORTED_COMPLETION = _SUPPORTED_COMMON | {"prompt"}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class RequestError(Exception):
    """A request the server refuses: `status` is the HTTP code, the message one line."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 kind: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.message, self.status, self.param, self.kind, self.code = message, status, param, kind, code

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class GenerationRequest:
    """One validated request: what the worker runs and how the answer is shaped."""

    endpoint: str              # "chat" | "completion"
    prompt_ids: tuple
    max_tokens: int
    sampling: SamplingParams
    stop: tuple = ()           # stop strings
    stream: bool = False
    include_usage: bool = False


# --- parsing --------------------------------------------------------------------------------
def parse_chat(body: Any, target, model_name: str) -> GenerationRequest:
    """Validate a /v1/chat/completions body; the prompt is the chat template over all messages."""
    body = _check_fields(body, _SUPPORTED_CHAT, _NEUTRAL_CHAT, model_name)
    tok = target.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise RequestError("this model has no chat template: use /v1/completions with a plain prompt")
    messages = _messages(body.get("messages"))
    try:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # a template may refuse e.g. a role order
        raise RequestError(f"the chat template rejected the messages: {e}", param="messages") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None \
            and body["max_tokens"] != body["max_completion_tokens"]:
        raise RequestError("give max_tokens or max_completion_tokens, not both with different values",
                           param="max_completion_tokens")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _request("chat", body, [int(i) for i in ids], target, name, None)


def parse_completion(body: Any, target, model_name: str) -> GenerationRequest:
    """Validate a /v1/completions body; the prompt is plain text (no chat template) or token ids."""
    body = _check_fields(body, _SUPPORTED_COMPLETION, _NEUTRAL_COMPLETION, model_name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            ids = target.encode_prompt(prompt, chat=False)
        except DiffspecError as e:
            raise RequestError(str(e), param="prompt") from None
    elif isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        if any(i < 0 or i >= target.vocab_size for i in prompt):
            raise RequestError(f"prompt token ids must be in [0, {target.vocab_size})", param="prompt")
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError("several prompts in one request are not supported: send one request per prompt",
                           param="prompt")
    else:
        raise RequestError("'prompt' is required: a non-empty string or a list of token ids", param="prompt")
    return _request("completion", body, ids, target, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)


def _check_fields(body: Any, supported: set, neutral: dict, model_name: str) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for key, value in body.items():
        if value is None or key in supported or key in _INERT:
            continue
        if key in neutral:
            if not any(value == v and type(value) is type(v) or _same_number(value, v) for v in neutral[key]):
                shown = repr(value)
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                raise RequestError(f"'{key}' is not supported by this server (got {shown}); leave it out",
                                   param=key, code="unsupported_parameter")
            continue
        raise RequestError(f"unrecognized request argument '{key}'", param=key, code="unknown_parameter")
    model = body.get("model")
    if model is not None and model != model_name:
        raise RequestError(f"model '{model}' is not served here; this server serves '{model_name}' (GET /v1/models)",
                           status=404, param="model", code="model_not_found")
    return body


def _same_number(value: Any, neutral: Any) -> bool:
    numbers = (int, float)
    return (isinstance(value, numbers) and isinstance(neutral, numbers) and not isinstance(value, bool)
            and not isinstance(neutral, bool) and value == neutral)


def _messages(messages: Any) -> list:
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' is required: a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content'", param="messages")
        extra = sorted(k for k, v in m.items() if k not in ("role", "content") and v is not None)
        if extra:
            raise RequestError(f"messages[{i}].{extra[0]} is not supported by this server", param="messages")
        role = m.get("role")
        if role not in _ROLES:
            raise RequestError(f"messages[{i}].role '{role}' is not supported (use system, developer, user or "
                               f"assistant)", param="messages")
        out.append({"role": _ROLES[role], "content": _content(m.get("content"), i)})
    return out


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"messages[{i}].content part of type '{kind}' is not supported (text only)",
                                   param="messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts", param="messages")


def _request(endpoint: str, body: dict, ids: list, target, max_name: str,
             default_max: Optional[int]) -> GenerationRequest:
    context = target.max_context
    room = context - len(ids)
    if room <= 0:
        raise RequestError(f"prompt has {len(ids)} tokens, more than fits in the model's context of {context} "
                           f"tokens (at least one new token must fit)", param="messages" if endpoint == "chat"
                           else "prompt", code="context_length_exceeded")
    max_tokens = body.get(max_name)
    if max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError(f"'{max_name}' must be an integer >= 1, got {max_tokens!r}", param=max_name)
    elif max_tokens > room:
        raise RequestError(f"the model's context is {context} tokens, but the prompt has {len(ids)} and "
                           f"{max_name} asks for {max_tokens} more; lower {max_name} to at most {room}",
                           param=max_name, code="context_length_exceeded")
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise RequestError(f"'temperature' must be >= 0 (0 = greedy), got {temperature!r}", param="temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise RequestError(f"'top_p' must be in (0, 1], got {top_p!r}", param="top_p")
    top_k = _integer(body, "top_k", 0)
    seed = _integer(body, "seed", None)
    if top_k < -1:
        raise RequestError(f"'top_k' must be >= 0 (0 or -1 = off), got {top_k!r}", param="top_k")
    if seed is not None and seed < 0:
        raise RequestError(f"'seed' must be >= 0, got {seed!r}", param="seed")
    try:
        sampling = SamplingParams(temperature=float(temperature), top_p=float(top_p), top_k=max(top_k, 0), seed=seed)
    except DiffspecError as e:
        raise RequestError(str(e)) from None
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError(f"'stream' must be true or false, got {stream!r}", param="stream")
    return GenerationRequest(endpoint=endpoint, prompt_ids=tuple(ids), max_tokens=max_tokens, sampling=sampling,
                             stop=_stops(body.get("stop")), stream=stream,
                             include_usage=_include_usage(body.get("stream_options"), stream))


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"'{name}' must be a finite number, got {value!r}", param=name)
    return value


def _integer(body: dict, name: str, default: Optional[int]) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{name}' must be an integer, got {value!r}", param=name)
    return value


def _stops(stop: Any) -> tuple:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    return tuple(stops)


def _include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise RequestError("'stream_options' is only allowed with 'stream': true", param="stream_options")
    if not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", param="stream_options")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise RequestError(f"stream_options.{unknown[0]} is not supported by this server", param="stream_options")
    value = options.get("include_usage")
    if value is not None and not isinstance(value, bool):
        raise RequestError("stream_options.include_usage must be true or false", param="stream_options")
    return bool(value)


# --- responses ------------------------------------------------------------------------------
def new_id(endpoint: str) -> str:
    return ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(endpoint: str, rid: str, model: str, text: str, finish: str, usage_obj: dict, spec: dict) -> dict:
    """The non-streaming answer."""
    if endpoint == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage_obj, "speculative": spec, "system_fingerprint": None}


def chunk(endpoint: str, rid: str, model: str, text: Optional[str], finish: Optional[str] = None,
          role: bool = False, usage_obj: Optional[dict] = None, spec: Optional[dict] = None,
          with_usage: bool = False, no_choices: bool = False) -> dict:
    """One streaming chunk; `no_choices` gives the final usage chunk (choices: [])."""
    if endpoint == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
           "choices": [] if no_choices else [choice], "system_fingerprint": None}
    if with_usage:
        out["usage"] = usage_obj
    if spec is not None:
        out["speculative"] = spec
    return out
