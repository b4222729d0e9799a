"""What the server reads out of a request body: the OpenAI fields, typed and bounded, the
sampling and speculation the engine is asked for, and the OpenAI-shaped error when it refuses."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, overload

from starlette.responses import JSONResponse

from ace_mw.directive import MAX_SPECULATIVE_TOKENS
from ace_mw.engine.params import EngineError, SamplingParams, SpecParams, chat_messages
from ace_mw.vocabulary import SPECULATIVE, Algorithm


class RequestError(Exception):
    """A request the server refuses, answered in the OpenAI error shape."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status
        self.kind = kind

    def to_openai_error(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.to_openai_error(), status_code=self.status)


# --- reading the request body ---------------------------------------------------------------


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a number, got {value!r}", name, "invalid_type")
    if not lo <= value <= hi:
        raise RequestError(f"{name} must be in [{lo}, {hi}], got {value}", name, "invalid_value")
    return float(value)


@overload
def _integer(body: dict, name: str, default: int, lo: int, hi: int | None = None) -> int: ...


@overload
def _integer(body: dict, name: str, default: None, lo: int, hi: int | None = None) -> int | None: ...


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}", name, "invalid_type")
    if value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise RequestError(f"{name} must be {bound}, got {value}", name, "invalid_value")
    return value


def _boolean(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean, got {value!r}", name, "invalid_type")
    return value


def _string(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise RequestError(f"{name} must be a string, got {value!r}", name, "invalid_type")
    return value


def _messages(body: dict) -> list[dict]:
    try:
        return chat_messages(body.get("messages"))
    except EngineError as exc:
        raise RequestError(str(exc), exc.param, exc.code) from None


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("prompt must be a string (one prompt per request)", "prompt", "invalid_prompt")
    return prompt


def _tree_choices(body: dict) -> list[list[int]] | None:
    tree = body.get("tree_choices")
    if tree is None:
        return None
    valid = (
        isinstance(tree, list)
        and tree
        and all(
            isinstance(path, list)
            and path
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in path)
            for path in tree
        )
    )
    if not valid:
        raise RequestError(
            "tree_choices must be a non-empty list of non-empty lists of child indices >= 0",
            "tree_choices",
            "invalid_tree_choices",
        )
    return tree


@dataclass(frozen=True)
class ServerOptions:
    """What the server does when a request leaves something out."""

    model_name: str
    draft_model_name: str | None = None  # the draft the engine loaded, as clients name it
    default_speculative: SpecParams | None = None  # None: baseline unless the request asks
    preferred_algorithm: str = Algorithm.EAGLE_2  # when a request asks for speculation but names no algorithm
    default_max_tokens: int = 256
    self_gate: bool = True  # the engine drafts per step only what pays (False: always the configured size)


def speculative_params(body: dict, options: ServerOptions) -> SpecParams | None:
    """The request's speculation (None = baseline), from its body fields and the server defaults."""
    use = _boolean(body, "use_speculative_decoding")
    algorithm = _string(body, "speculative_algorithm")
    draft = _string(body, "speculative_draft_model")
    k = _integer(body, "num_speculative_tokens", None, lo=1, hi=MAX_SPECULATIVE_TOKENS)
    tree = _tree_choices(body)
    if draft is not None and draft != options.draft_model_name:
        loaded = options.draft_model_name or "none"
        raise RequestError(
            f"unknown speculative_draft_model {draft!r}: this server loaded {loaded!r}",
            "speculative_draft_model",
            "unknown_draft_model",
        )
    if use is False or algorithm == Algorithm.BASELINE:
        return None
    asked = use or any(v is not None for v in (algorithm, draft, k, tree))
    if not asked:
        return options.default_speculative
    default = options.default_speculative or SpecParams(algorithm=options.preferred_algorithm)
    algorithm = algorithm or (Algorithm.DRAFT_MODEL if draft is not None else default.algorithm)
    if algorithm not in SPECULATIVE:
        raise RequestError(
            f"unknown speculative_algorithm {algorithm!r}: expected one of " + ", ".join(Algorithm),
            "speculative_algorithm",
            "unknown_speculative_algorithm",
        )
    return SpecParams(
        algorithm=algorithm,
        num_speculative_tokens=k if k is not None else default.num_speculative_tokens,
        tree_choices=tree if tree is not None else default.tree_choices,
        total_tokens=default.total_tokens,
        self_gate=options.self_gate,
    )


@dataclass(frozen=True)
class CompletionRequest:
    """One parsed, validated request: everything the engine call and the reply need."""

    chat: bool
    prompt: Any  # list of messages (chat) or a string (completions)
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    speculative: SpecParams | None

    @classmethod
    def parse(cls, body: dict, chat: bool, options: ServerOptions) -> CompletionRequest:
        model = body.get("model")
        if model is not None and model != options.model_name:
            raise RequestError(
                f"The model {model!r} does not exist; this server serves {options.model_name!r}",
                "model",
                "model_not_found",
                status=404,
            )
        n = _integer(body, "n", 1, lo=1)
        if n != 1:
            raise RequestError(
                f"n = {n}: this server returns one choice per request; send {n} requests instead", "n", "unsupported"
            )
        if body.get("logprobs") not in (None, False):
            raise RequestError("logprobs are not supported by this server", "logprobs", "unsupported")
        max_tokens = _integer(body, "max_completion_tokens", None, lo=1)
        if max_tokens is None:
            max_tokens = _integer(body, "max_tokens", options.default_max_tokens, lo=1)
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise RequestError("stream_options must be an object", "stream_options", "invalid_type")
        top_k = _integer(body, "top_k", 0, lo=-1)
        try:
            sampling = SamplingParams(
                max_new_tokens=max_tokens,
                temperature=_number(body, "temperature", 1.0, 0.0, 2.0),  # OpenAI's range
                top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
                top_k=max(top_k, 0),  # vLLM spells "no top-k" as -1
                seed=_integer(body, "seed", None, lo=-(2**63)),
                stop=body.get("stop"),
            )
        except EngineError as exc:
            raise RequestError(str(exc), exc.param, exc.code) from None
        return cls(
            chat=chat,
            prompt=_messages(body) if chat else _prompt(body),
            sampling=sampling,
            stream=bool(_boolean(body, "stream")),
            include_usage=bool(_boolean(stream_options, "include_usage")),
            speculative=speculative_params(body, options),
        )

    def engine_kwargs(self) -> dict:
        return {"sampling": self.sampling, "speculative": self.speculative}
