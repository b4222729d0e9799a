"""The target's one-token step, and its verified chains, compiled by ``torch.compile`` (inductor,
C++ wrapper), for decoding on a CPU.

Why: a one-token step of the fixture is about 3.5 ms of weight reads inside 5.4 ms (1 thread; 1.8
of 3.5 ms on 2). The rest is some 1,100 small dispatches (views, norms, RoPE, the cache write):
fusing q/k/v and gate/up by hand saved a few percent of it. Compiled, the step is one generated
function, about 1.5x faster at 1 and 2 threads: 1.21-1.29x llama.cpp f32 at 1 thread, 0.91-1.00x at
2 (``benchmarks/decode.py``, docs/engine.md). Chains of up to ``CHAIN_TOKENS`` (prompt lookup's and a
draft model's verify passes) share a graph of dynamic length. A prefill, a tree (its mask) or a
step with taps runs eagerly: their shapes vary, and compiling each would cost more than it saves.

What it costs: about 40 s of compiling at the first start on a 2-core machine (inductor caches
the result on disk: about 7 s at a restart), and exactness. Inductor fuses the norms and sums in
another order, so logits differ from eager ones by about 1e-5. Greedy output then equals the
eager engine's except at near-ties (tested with ``FP32_NEAR_TIE``, as batching is), so the engine
compiles only when asked (``Engine(steps="compiled")``, the server's ``--compile-decode``); eager
fp32 stays exact.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from .step import Step
from .transformer import Transformer

WARM_UP_POSITIONS = (0, 1, 2)  # the first call specialises the attended length, the second makes it dynamic
WARM_UP_CHAINS = (2, 3)  # and the same for a chain's length
CHAIN_TOKENS = 16  # the longest chain verified compiled (prompt lookup's and a draft model's are shorter)
TIMED = (1, 8)  # the step sizes warm_up times, compiled against eager


class DecodeCompileError(RuntimeError):
    """The step could not be compiled here: most often no C++ compiler for inductor (``g++``, or
    ``CXX``). Eager steps need none."""


class CompiledDecode:
    """The target with its one-token steps and verified chains compiled: the same call as
    ``Transformer.forward``."""

    def __init__(self, model: Transformer):
        self.model = model
        self.compiled = torch.compile(model.forward, fullgraph=True, options={"cpp_wrapper": True})
        self.timed: dict[int, float] = {}  # size -> compiled / eager time, once warm_up has run

    def __getattr__(self, name):  # embed_tokens, lm_head, config, caches, compact_cache, ...
        return getattr(self.model, name)

    def __call__(
        self, input_ids: Tensor, at: Tensor | Step, last_logits_only: bool = False, taps: tuple[int, ...] = ()
    ) -> tuple[Tensor, Tensor]:
        chain = isinstance(at, Step) and at.mask is None and input_ids.shape[1] <= CHAIN_TOKENS
        if chain and not taps and not last_logits_only:
            return self.compiled(input_ids, at)
        return self.model(input_ids, at, last_logits_only, taps)

    def ratio(self, q: int) -> float:
        """A pass over ``q`` tokens, compiled over eager: the nearest timed size's; 1 where it runs eagerly."""
        if q > CHAIN_TOKENS or not self.timed:
            return 1.0
        return self.timed[min(self.timed, key=lambda size: abs(size - q))]

    @torch.inference_mode()
    def warm_up(self, rounds: int = 20) -> None:
        """Compile now rather than on a request's first token, then time each size in ``TIMED``
        compiled against eager (round-robin) for ``ratio``. Writes only cache slots a prefill
        overwrites."""
        device = self.model.embed_tokens.weight.device

        def tokens(q: int) -> Tensor:  # fresh, as a request's are (a slice's strides would get a graph of its own)
            return torch.zeros(1, q, dtype=torch.long, device=device)

        try:
            for position in WARM_UP_POSITIONS:
                self(tokens(1), Step.span(position, 1, device))
            for q in WARM_UP_CHAINS:
                self(tokens(q), Step.span(WARM_UP_POSITIONS[-1], q, device))
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            reason = str(exc).strip().splitlines()[0]
            raise DecodeCompileError(f"cannot compile the decode step ({reason}); run it eagerly instead") from None
        fastest = {(kind, q): float("inf") for kind in ("compiled", "eager") for q in TIMED}
        for _ in range(rounds):
            for (kind, q), ms in fastest.items():
                step, at = self if kind == "compiled" else self.model, Step.span(WARM_UP_POSITIONS[-1], q, device)
                started = time.perf_counter()
                step(tokens(q), at)
                fastest[kind, q] = min(ms, time.perf_counter() - started)
        self.timed = {q: fastest["compiled", q] / fastest["eager", q] for q in TIMED}
