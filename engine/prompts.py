"""Held-out benchmark prompts in four categories: code, summarization, chat, math.

Speculative decoding's gain depends on the text (code and extraction repeat their input, chat
does not), so the benchmark reports each category. The first user turns of
`models/chat_eval.json` (conversations the models never trained on) are split by keyword
heuristics; `models/bench_prompts.json` tops up categories the split leaves thin.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from .bundled import MODELS_DIR

CATEGORIES = ("code", "summarization", "chat", "math")

# Checked in this order: the first category whose pattern matches wins; "chat" is the rest.
_PATTERNS = {
    "code": re.compile(
        r"```|\b(python|javascript|typescript|java|c\+\+|sql|bash|html|css|react|function|code|script|"
        r"class|api|json|regex|regular expressions?|program|compile|docker|kubernetes|git)\b",
        re.I,
    ),
    "math": re.compile(
        r"\b(math\w*|calculat\w*|solve|equations?|probability|prove|proof|puzzle|riddle|integral|"
        r"derivative|algebra)\b|\d\s*[+*^=]\s*\d",
        re.I,
    ),
    "summarization": re.compile(
        r"\b(summar\w*|tl;?dr|extract\w*|key points|bullet points|main points|paraphrase|shorten|condense)\b", re.I
    ),
}


def categorize(text: str) -> str:
    """The category a prompt falls in by keywords (code, then math, then summarization, else chat)."""
    for category, pattern in _PATTERNS.items():
        if pattern.search(text):
            return category
    return "chat"


def load_prompts(
    per_category: int,
    *,
    eval_path: Path | None = None,
    extra_path: Path | None = None,
    fits: Callable[[str], bool] = lambda text: True,
) -> dict[str, list[str]]:
    """`per_category` prompts per category, held-out conversations first, then the bundled extras.

    `fits` filters out prompts the benchmark cannot use (e.g. too long for the context).
    """
    eval_path = eval_path or MODELS_DIR / "chat_eval.json"
    extra_path = extra_path or MODELS_DIR / "bench_prompts.json"
    pools: dict[str, list[str]] = {c: [] for c in CATEGORIES}
    for conversation in json.loads(eval_path.read_text()):
        role, text = conversation["turns"][0]
        if role == "user" and text.strip():
            pools[categorize(text)].append(text)
    for category, pattern in _PATTERNS.items():  # clearest cases first: most keyword hits
        pools[category].sort(key=lambda text: -len(pattern.findall(text)))
    extras = json.loads(extra_path.read_text())
    chosen = {}
    for category in CATEGORIES:
        usable = [t for t in pools[category] + extras[category] if fits(t)]
        if len(usable) < per_category:
            raise ValueError(f"only {len(usable)} usable {category} prompts, asked for {per_category}")
        chosen[category] = usable[:per_category]
    return chosen
