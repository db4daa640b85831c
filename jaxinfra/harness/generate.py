"""lm-eval's generate_until on jaxinfra's Generator (jaxinfra/infer/generation.py): batched, greedy
unless the request asks to sample, stopped by lm-eval's stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _stop_strings(until: Any, eos: str) -> list[str]:
    """The request's `until` as a list, the end-of-text's text added (as lm-eval's HF model does)."""
    until = [until] if isinstance(until, str) else list(until or [])
    return until if eos in until else [*until, eos]


def _sampling(kwargs: dict) -> Any:
    from jaxinfra.infer.generation import Sampling

    if not kwargs.get("do_sample") or not kwargs.get("temperature"):
        return Sampling()  # greedy, as HF when do_sample is false
    return Sampling(temperature=float(kwargs["temperature"]), top_k=int(kwargs.get("top_k") or 0),
                    top_p=float(kwargs.get("top_p") or 1.0), seed=int(kwargs.get("seed") or 0))


def generate_texts(lm: Any, requests: Sequence[tuple[str, dict]]) -> list[str]:
    """Each (context, gen_kwargs)'s continuation text, cut before its first stop string. Requests
    with equal gen_kwargs go together, longest context first, in batches of the LM's fixed row count
    (a short last batch is filled with one-token prompts, so the programs compile once per prompt bucket)."""
    from lm_eval.models.utils import normalize_gen_kwargs

    groups: dict[str, list[int]] = {}
    for i, (_, kwargs) in enumerate(requests):
        groups.setdefault(repr(sorted(kwargs.items())), []).append(i)
    out = [""] * len(requests)
    for members in groups.values():
        kwargs = normalize_gen_kwargs(requests[members[0]][1], lm.max_gen_toks)
        until = _stop_strings(kwargs.get("until"), lm.tok.eot_text())
        max_new = int(kwargs["max_gen_toks"])
        keep = max(1, lm.max_length - max_new)  # the context's last ids, as HF left-truncates
        prompts = {i: lm.tok_encode(requests[i][0])[-keep:] or [lm.prefix_token_id] for i in members}
        members = sorted(members, key=lambda i: -len(prompts[i]))
        for lo in range(0, len(members), lm.scorer.batch):
            chunk = members[lo:lo + lm.scorer.batch]
            for i, text in zip(chunk, _generate_batch(lm, [prompts[i] for i in chunk], max_new, until, kwargs)):
                out[i] = text
    return out


def _generate_batch(lm: Any, prompts: list[list[int]], max_new: int, until: list[str], kwargs: dict) -> list[str]:
    # a stop string that is one token ends its row inside the decode loop; the others cut the text after
    single = [ids[0] for ids in (lm.tok_encode(s) for s in until if s) if len(ids) == 1]
    rows = prompts + [[lm.prefix_token_id]] * (lm.scorer.batch - len(prompts))
    result = lm.generator.generate(rows, max_new_tokens=max_new, sampling=_sampling(kwargs),
                                   stop_ids=sorted({*single, *lm.tok.stop_ids}), params=lm.scorer.params)
    texts = []
    for ids in result.tokens[:len(prompts)]:
        text = lm.tok_decode(ids)
        for stop in until:
            if stop:
                text = text.split(stop)[0]
        texts.append(text)
    return texts
