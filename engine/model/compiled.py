"""The target's one-token step compiled by ``torch.compile`` (inductor, C++ wrapper), for plain
decoding on a CPU.

Why: a one-token step of the fixture is about 3.5 ms of weight reads inside 5.4 ms (1 thread; 1.8
of 3.5 ms on 2). The rest is some 1,100 small dispatches (views, norms, RoPE, the cache write):
fusing q/k/v and gate/up by hand saved a few percent of it. Compiled, the step is one generated
function, about 1.5x faster at 1 and 2 threads: 1.25-1.29x llama.cpp f32 at 1 thread, 0.91-1.00x at
2 (``benchmarks/decode.py``, docs/engine.md). A prefill, a verify pass or a step with taps runs eagerly: their
shapes vary, and compiling each would cost more than it saves.

What it costs: about 15 s of compiling at start on a 2-core machine (inductor caches the result on
disk, so a restart takes a few), and exactness. Inductor fuses the norms and sums in another order, so logits
differ from eager ones by about 1e-5. Greedy output then equals the eager engine's except at
near-ties (tested with ``FP32_NEAR_TIE``, as batching is), so the engine compiles only when asked
(``Engine(steps="compiled")``, the server's ``--compile-decode``); eager fp32 stays exact.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from .step import Step
from .transformer import Transformer

WARM_UP_POSITIONS = (0, 1, 2)  # the first call specialises the attended length, the second makes it dynamic


class DecodeCompileError(RuntimeError):
    """The step could not be compiled here: most often no C++ compiler for inductor (``g++``, or
    ``CXX``). Eager steps need none."""


class CompiledDecode:
    """The target with its one-token steps compiled: the same call as ``Transformer.forward``."""

    def __init__(self, model: Transformer):
        self.model = model
        self.compiled = torch.compile(model.forward, fullgraph=True, options={"cpp_wrapper": True})

    def __getattr__(self, name):  # embed_tokens, lm_head, config, caches, compact_cache, ...
        return getattr(self.model, name)

    def __call__(
        self, input_ids: Tensor, at: Tensor | Step, last_logits_only: bool = False, taps: tuple[int, ...] = ()
    ) -> tuple[Tensor, Tensor]:
        if input_ids.shape[1] == 1 and isinstance(at, Step) and at.mask is None and not taps:
            return self.compiled(input_ids, at, last_logits_only)
        return self.model(input_ids, at, last_logits_only, taps)

    @torch.inference_mode()
    def warm_up(self, rounds: int = 20) -> float:
        """Compile now rather than on a request's first token; returns a compiled step's time over an
        eager one's (timed round-robin), for the planner's price of a plain step. Writes only cache
        slots a prefill overwrites."""
        token = torch.zeros(1, 1, dtype=torch.long, device=self.model.embed_tokens.weight.device)
        try:
            for position in WARM_UP_POSITIONS:
                self(token, Step.span(position, 1, token.device))
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            reason = str(exc).strip().splitlines()[0]
            raise DecodeCompileError(f"cannot compile the decode step ({reason}); run it eagerly instead") from None
        at = Step.span(WARM_UP_POSITIONS[-1], 1, token.device)
        fastest = {"compiled": float("inf"), "eager": float("inf")}
        for _ in range(rounds):
            for name, step in (("compiled", self), ("eager", self.model)):
                started = time.perf_counter()
                step(token, at)
                fastest[name] = min(fastest[name], time.perf_counter() - started)
        return fastest["compiled"] / fastest["eager"]
