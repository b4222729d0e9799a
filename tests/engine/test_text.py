"""StreamText, the incremental detokeniser: what it releases is exactly the tokenizer's text of the ids
it kept, cut before a stop string, however the ids arrive; and each push decodes only its tail."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from ace_mw.engine.prompts import MODELS_DIR
from ace_mw.engine.text import StreamText

TEXTS = ["Hello world, ünïcödé 日本語 🙂 emoji", "def f(x):\n    return x + 1\n", "Stop here. END more text"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODELS_DIR / "ace-tiny-chat", local_files_only=True)


def stream(tokenizer, ids: list[int], sizes: list[int], stops: list[str]) -> tuple[str, list[int], bool]:
    text, out, kept, i = StreamText(tokenizer, stops), [], [], 0
    for size in sizes:
        delta, new, stopped = text.push(ids[i : i + size])
        out.append(delta)
        kept += new
        i += size
        if stopped or i >= len(ids):
            break
    out.append(text.flush())
    return "".join(out), kept, stopped


def cases(tokenizer, n: int):
    """Token ids of text (multi-byte characters split across tokens) and random ids (bytes that
    never complete a character), each cut into random pushes of 1-4 ids, as speculative steps emit."""
    rng = random.Random(0)
    for trial in range(n):
        if trial % 2:
            ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 60))]
        else:
            ids = tokenizer(rng.choice(TEXTS) * rng.randrange(1, 3), add_special_tokens=False).input_ids
        yield ids, [rng.randrange(1, 5) for _ in ids], rng


def test_what_it_releases_is_the_tokenizers_text_of_the_ids(tokenizer):
    for ids, sizes, _ in cases(tokenizer, 200):
        text, kept, stopped = stream(tokenizer, ids, sizes, [])
        assert kept == ids and not stopped
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_stop_string_cuts_the_text_right_before_it(tokenizer):
    for ids, sizes, rng in cases(tokenizer, 200):
        stops = rng.choice([["END"], ["\n"], ["ld,", "🙂"], ["x + "]])
        text, kept, stopped = stream(tokenizer, ids, sizes, stops)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        hits = [i for i in (full.find(s) for s in stops) if i >= 0]
        if not hits:
            assert not stopped and text == full and kept == ids
            continue
        assert stopped and text == full[: min(hits)]
        # the kept ids end with the one that completed the stop string
        kept_text = tokenizer.decode(kept, skip_special_tokens=True)
        assert any(s in kept_text for s in stops)
        assert not any(s in tokenizer.decode(kept[:-1], skip_special_tokens=True) for s in stops)


def test_each_push_decodes_only_the_tail_not_the_whole_output(tokenizer):
    decoded: list[int] = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            decoded.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 60, add_special_tokens=False).input_ids
    text = StreamText(Counting(), [])
    released = "".join(text.push([token])[0] for token in ids) + text.flush()
    assert released == tokenizer.decode(ids)
    assert len(ids) > 500 and max(decoded) <= 4
