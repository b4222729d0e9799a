"""What the engine server's tests share (test_server.py, test_server_load.py): the bundled models,
the prompts and the way they are asked, their solo answers, and a batch's step costs (the engine
itself: tests/engine/conftest.py)."""

import openai

from ace_mw.engine import Engine
from ace_mw.engine.planning.batch import BatchCosts
from ace_mw.engine.planning.cost import CostCurve

MODEL = "ace-tiny-chat"
MAX_TOKENS = 16
PROMPTS = (
    "Write a Python function that reverses a string.",
    "Summarize the plot of Hamlet in one sentence.",
    "What is the capital of France?",
    "Solve for x: 2x + 3 = 11.",
)
SPECULATIVE = ("draft_model", "ngram", "eagle", "eagle_2", "eagle_3")  # the engine has every drafter


# Batched steps priced as a memory-bound machine's: fixed per forward, a little per token.
BATCH_COSTS = BatchCosts({b: CostCurve({1: 10.0 + b, 16: 12.0 + 4 * b}) for b in (1, 2, 4, 8)})


def messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def solo_answers(engine: Engine) -> dict[str, str]:
    """Each prompt's greedy baseline text, decoded alone (the reference every server answer must equal)."""
    return {p: engine.generate(messages(p), max_new_tokens=MAX_TOKENS, temperature=0.0).text for p in PROMPTS}


def chat(client: openai.OpenAI, text: str, temperature: float = 0.0, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=messages(text), max_tokens=MAX_TOKENS, temperature=temperature, **kwargs
    )
