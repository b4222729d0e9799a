"""What one request asks the engine for, validated once, for the Python API and the server alike.

`SamplingParams` (how to sample, how long, where to stop) and `SpecParams` (how to speculate) are
plain frozen values; `chat_messages` reads OpenAI chat messages. Each check raises `EngineError`
naming the field at fault (`param`, as in OpenAI's error body), so the server's 400 and the API's
exception say the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ace_mw.vocabulary import Algorithm

from .drafting.sampling import Sampling

# The roles a chat template knows; "developer" (OpenAI's newer name for "system") is read as system.
ROLES = ("system", "developer", "user", "assistant")


class EngineError(ValueError):
    """A bad request: unknown algorithm, K out of range, prompt too long, invalid messages."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


MAX_TREE_TOKENS = 128  # the most tree nodes a request may verify a step (total_tokens)


@dataclass(frozen=True)
class SpecParams:
    algorithm: str = Algorithm.EAGLE_2
    # Chain length (draft_model, ngram) or tree depth (eagle_2, eagle_3); None = the algorithm's default K.
    num_speculative_tokens: int | None = None
    tree_choices: list[list[int]] | None = None  # eagle's static tree; None = EAGLE-1's 25 nodes
    # eagle_2/eagle_3 tree budget; None = chosen per step (self_gate) or from the verify-cost curve.
    total_tokens: int | None = None
    # Draft per step only as much as pays on this machine, nothing included (True), or always
    # draft the configured size (False). Output is identical either way; only speed differs.
    self_gate: bool = True


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it ends. ``temperature`` 0 is greedy; ``top_k`` 0 and
    ``top_p`` 1 leave the distribution whole; ``seed`` None draws fresh entropy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stops: tuple[str, ...] = field(init=False, repr=False, compare=False)  # ``stop`` as a tuple

    def __post_init__(self) -> None:
        _integer("max_new_tokens", self.max_new_tokens, "an integer >= 1", lo=1)
        _real("temperature", self.temperature, "in [0, 100]", lambda t: 0.0 <= t <= 100.0)
        _real("top_p", self.top_p, "in (0, 1]", lambda p: 0.0 < p <= 1.0)
        _integer("top_k", self.top_k, "an integer >= 0", lo=0)
        if self.seed is not None:
            _integer("seed", self.seed, "an integer", lo=None)
        stop = self.stop
        stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, (list, tuple)) else (stop,)
        if stop is not None and not all(isinstance(s, str) and s for s in stops):
            raise EngineError("stop: expected a non-empty string or a list of them", "stop")
        object.__setattr__(self, "stops", stops if stop is not None else ())

    def sampling(self, device: torch.device) -> Sampling:
        """The decoding loop's sampler, with its own generator: the global RNG is never touched."""
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return Sampling(float(self.temperature), float(self.top_p), self.top_k, generator)


def _integer(name: str, value: object, expected: str, lo: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo):
        raise EngineError(f"{name} must be {expected}, got {value!r}", name)


def _real(name: str, value: object, expected: str, valid) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not valid(value):
        raise EngineError(f"{name} must be {expected}, got {value!r}", name)


def chat_messages(messages: object) -> list[dict]:
    """OpenAI chat messages as a chat template wants them: text content parts joined to one
    string, "developer" read as "system"."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise EngineError(
            "messages: expected a prompt string or a non-empty list of {role, content} objects",
            "messages",
            "invalid_messages",
        )
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise EngineError(f"{where}: expected an object", where, "invalid_messages")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise EngineError(
                f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role", "invalid_messages"
            )
        if isinstance(content, list):  # OpenAI content parts: text only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise EngineError(
                    f"{where}.content: only text parts are supported", f"{where}.content", "invalid_messages"
                )
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise EngineError(
                f"{where}.content: expected a string or a list of text parts", f"{where}.content", "invalid_messages"
            )
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out
