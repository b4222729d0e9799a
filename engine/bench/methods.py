"""What the bench times: a `Method` (a named way to decode) and its `Run`s, for our engine's
algorithms and for transformers' own decoding (the peers), with what each adds to memory."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ace_mw.engine import Engine, SpecParams
from ace_mw.vocabulary import Algorithm

GATED = " self-gated"  # the suffix of a self-gated method's name
HF_GENERATE = "hf generate"


@dataclass
class Run:
    """One method on one prompt."""

    category: str
    tokens: list[int]
    ttft_s: float
    tpot_s: float
    steps: int  # target forward passes after the prefill (which emits the first token)
    drafted: int | None = None  # None: the method does not say
    accepted: int | None = None
    plain_steps: int | None = None  # verify steps that drafted nothing


@dataclass
class Method:
    """A named way to decode: `decode(messages, max_new_tokens, temperature, seed)` -> Run fields."""

    name: str
    decode: Callable[..., Run]
    memory_bytes: Callable[[], int] = lambda: 0  # asked after the runs, when lazy caches exist
    runs: list[Run] = field(default_factory=list)


def module_bytes(*modules: nn.Module | None) -> int:
    """Bytes held by parameters and buffers (static KV caches are buffers) of the given modules."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        if module is None:
            continue
        for t in list(module.parameters()) + list(module.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def kv_cache_bytes(config, tokens: int, dtype=torch.float32) -> int:
    """Keys and values of every layer for `tokens` positions (a Hugging Face config)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return per_token * tokens * torch.tensor([], dtype=dtype).element_size()


# --- our engine --------------------------------------------------------------------------------


def engine_method(
    engine: Engine,
    algorithm: str,
    num_speculative_tokens: int | None = None,
    total_tokens: int | None = None,
    self_gate: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> Method:
    budget = total_tokens if Algorithm(algorithm).grows_tree else None  # else from the verify-cost curve
    spec = (
        None
        if algorithm == Algorithm.BASELINE
        else SpecParams(
            algorithm=algorithm, num_speculative_tokens=num_speculative_tokens, total_tokens=budget, self_gate=self_gate
        )
    )

    def decode(category, messages, max_new_tokens, temperature, seed) -> Run:
        chunks = engine.stream(
            messages, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, speculative=spec
        )
        last = next(chunks)  # the prefill's token: decode time starts here
        started, tokens = clock(), list(last.token_ids)
        for last in chunks:
            tokens.extend(last.token_ids)
        decode_s, s = clock() - started, last.stats
        assert s is not None  # the last chunk carries the stats
        return Run(
            category,
            tokens,
            s.ttft_s,
            decode_s / (len(tokens) - 1) if len(tokens) > 1 else 0.0,
            s.steps,
            s.drafted if spec else None,
            s.accepted if spec else None,
            s.plain_steps,
        )

    drafter = engine.drafts_with(algorithm)
    return Method(algorithm + (GATED if self_gate else ""), decode, lambda: module_bytes(drafter))


# --- transformers peers ------------------------------------------------------------------------


class StepClock:
    """A transformers streamer that timestamps every put: the prompt, then one put per target forward."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(self.clock())

    def end(self) -> None:
        self.times.append(self.clock())


def hf_method(
    name: str,
    model,
    tokenizer,
    memory_bytes: Callable[[], int] = lambda: 0,
    clock: Callable[[], float] = time.perf_counter,
    **generate_kwargs,
) -> Method:
    eos = tokenizer.eos_token_id

    def decode(category, messages, max_new_tokens, temperature, seed) -> Run:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
            if temperature > 0
            else {"do_sample": False}
        )
        if seed is not None:
            torch.manual_seed(seed)
        steps = StepClock(clock)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                streamer=steps,
                pad_token_id=eos,
                eos_token_id=eos,
                **sampling,
                **generate_kwargs,
            )
        tokens = out[0, ids.shape[1] :].tolist()
        if eos in tokens:  # the engine's convention: generated ids without the eos token
            tokens = tokens[: tokens.index(eos)]
        # times: [prompt put, first token (prefill), one put per verify/decode forward..., end]
        ttft = steps.times[1] - steps.times[0]
        decode_s = steps.times[-1] - steps.times[1]
        return Run(category, tokens, ttft, decode_s / max(len(tokens) - 1, 1), len(steps.times) - 3)

    return Method(name, decode, memory_bytes)


def hf_methods(
    target: str,
    draft: str | None,
    device: str,
    max_len: int,
    clock: Callable[[], float] = time.perf_counter,
    dtype: torch.dtype = torch.float32,
) -> list[Method]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device).eval()
    methods = [hf_method(HF_GENERATE, model, tokenizer, clock=clock)]
    if draft:
        assistant = AutoModelForCausalLM.from_pretrained(draft, dtype=dtype).to(device).eval()
        memory = module_bytes(assistant) + kv_cache_bytes(assistant.config, max_len, dtype)
        methods.append(
            hf_method("hf assisted (draft)", model, tokenizer, lambda: memory, clock, assistant_model=assistant)
        )
    methods.append(hf_method("hf prompt lookup", model, tokenizer, clock=clock, prompt_lookup_num_tokens=10))
    return methods
