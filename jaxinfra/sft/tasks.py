"""Synthetic chat tasks for tests and the docs' measured recipe (docs/post-training.md).

    train, held = capitals_chat(8000, seed=0)          # rows {"messages": [user, assistant]}
    write_jsonl(train, "train.jsonl")
    rate, replies = held_out_rate("runs/chat", held)    # greedy generate --chat, exact match

capitals_chat: "Write xlimt in capitals" -> "XLIMT" (random 4-8 letter words): the task a tiny
byte-level model learns to >= 90% exact fastest of those measured (docs/post-training.md), so the
acceptance test uses it. addition_chat: "What is 37 plus 45?" -> "82" (two-digit numbers). The
held-out prompts are 100 that no training row holds (disjoint by word, by pair), so a model that
scores on them has learned the rule, not the rows.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence

import numpy as np

from jaxinfra.atomic import atomic_write_text

Row = dict[str, list[dict[str, str]]]


def addition_row(a: int, b: int) -> Row:
    return {"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                         {"role": "assistant", "content": str(a + b)}]}


def addition_chat(n: int, seed: int = 0, held_out: int = 100) -> tuple[list[Row], list[Row]]:
    """(n training rows, `held_out` rows) of two-digit additions; no (a, b) pair is in both
    (training rows may repeat a pair when n exceeds the 8100 - held_out pairs left)."""
    rng = np.random.default_rng(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    order = rng.permutation(len(pairs))
    held = [pairs[i] for i in order[:held_out]]
    rest = [pairs[i] for i in order[held_out:]]
    train = [rest[i] for i in rng.integers(0, len(rest), n)] if n > len(rest) else rest[:n]
    return [addition_row(a, b) for a, b in train], [addition_row(a, b) for a, b in held]


def capitals_row(word: str) -> Row:
    return {"messages": [{"role": "user", "content": f"Write {word} in capitals"},
                         {"role": "assistant", "content": word.upper()}]}


def capitals_chat(n: int, seed: int = 0, held_out: int = 100, lengths: tuple[int, int] = (4, 8)) -> tuple[
        list[Row], list[Row]]:
    """(n training rows, `held_out` rows) writing random lowercase words of `lengths` letters in
    capitals; no held-out word is a training word."""
    words = _random_words(n + held_out * 2, seed, lengths)
    held = list(dict.fromkeys(words[:held_out * 2]))[:held_out]
    taken = set(held)
    train = [w for w in words[held_out * 2:] if w not in taken]
    return [capitals_row(w) for w in train[:n]], [capitals_row(w) for w in held]


def _random_words(n: int, seed: int, lengths: tuple[int, int]) -> list[str]:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(lengths[0], lengths[1] + 1, n)
    letters = rng.integers(0, 26, (n, lengths[1]))
    return ["".join(chr(97 + c) for c in row[:k]) for row, k in zip(letters, sizes, strict=True)]


def prompt(row: Mapping) -> str:
    """The user turn of a task row."""
    return row["messages"][0]["content"]


def answer(row: Mapping) -> str:
    """The assistant reply a task row expects."""
    return row["messages"][-1]["content"]


def exact_match(replies: Sequence[str], answers: Sequence[str]) -> float:
    """The share of replies that equal their answer exactly (surrounding whitespace ignored)."""
    if len(replies) != len(answers) or not answers:
        raise ValueError(f"{len(replies)} replies for {len(answers)} answers")
    return sum(r.strip() == a.strip() for r, a in zip(replies, answers, strict=True)) / len(answers)


def write_jsonl(rows: Sequence[Row], path: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(path)
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows), replace=True)
    return path


def held_out_rate(run: str | pathlib.Path, rows: Sequence[Mapping], max_new_tokens: int = 24,
                  overrides: Sequence[str] = ()) -> tuple[float, list[str]]:
    """(exact-match rate, replies) of greedy `generate --chat` (the function the CLI calls, batched)
    on the user turns of `rows`, against their assistant replies."""
    from jaxinfra.infer import Generator, chat_replies, load_model, resolve_checkpoint, run_chat_template

    cfg, params = load_model(run, overrides)
    template, encoder = run_chat_template(cfg, resolve_checkpoint(run)[0])
    replies, _ = chat_replies(Generator(cfg, params), template, encoder, [prompt(r) for r in rows],
                              max_new_tokens=max_new_tokens)
    return exact_match(replies, [answer(r) for r in rows]), replies
