"""`jaxinfra generate --chat`: one user turn through the run's chat template, the reply alone.

The prompt is rendered by the template the run trained with (data.chat_template, through
jaxinfra/data/chat.py `encode_chat_prompt`: the generation prompt added), so the model sees what
SFT showed it. A reply stops at the template's end-of-turn, inside the decode loop: one stop id when
the tokenizer has it as a single token, else (byte-level) a stop sequence of its ids; the printed
reply is the text before it.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from jaxinfra.config import Config
from jaxinfra.data.chat import ChatTemplate, encode_chat_prompt, end_of_turn_ids, load_chat_template
from jaxinfra.data.encode import Encoder, make_encoder
from jaxinfra.infer.generation import GenerationResult, Generator, Sampling
from jaxinfra.infer.loading import InferenceError

GREEDY = Sampling()


def run_file(path: str, run_dir: str | pathlib.Path | None) -> str:
    """A file the run's config names (data.tokenizer, a template): as given, else beside the run dir."""
    beside = pathlib.Path(run_dir) / path if run_dir is not None else None
    if not pathlib.Path(path).is_file() and not pathlib.Path(path).is_absolute() and beside and beside.is_file():
        return str(beside)
    return path


def run_chat_template(cfg: Config, run_dir: str | pathlib.Path | None = None) -> tuple[ChatTemplate, Encoder]:
    """The chat template and encoder of the run (its data.chat_template and data.tokenizer)."""
    data = cfg.data
    # prompts: a GRPO run, its chat prompts rendered the same way; an HF model's own template (an `hf import`
    # carries it: data.chat_template=tokenizer) is the template it was tuned with, whatever data.source is.
    own = data.chat_template == "tokenizer" and data.tokenizer is not None
    if data.source not in ("chat", "prompts") and not own:
        raise InferenceError(f"--chat needs a run trained on chat data (data.source=chat, or prompts for GRPO) or "
                             f"a tokenizer with its chat template; this run's data.source is {data.source!r}")
    tokenizer = run_file(data.tokenizer, run_dir) if data.tokenizer is not None else None
    spec = data.chat_template
    if spec not in ("chatml", "tokenizer"):
        spec = run_file(spec, run_dir)
    return load_chat_template(spec, tokenizer), make_encoder(tokenizer)


def end_of_turn_id(template: ChatTemplate, encoder: Encoder) -> int | None:
    """The end-of-turn as one token id (None: byte-level, or several tokens, or none)."""
    ids = end_of_turn_ids(template, encoder)
    return int(ids[0]) if len(ids) == 1 else None


def reply_text(template: ChatTemplate, encoder: Encoder, ids: Sequence[int]) -> str:
    """The generated ids' text up to (without) the first end-of-turn."""
    text = encoder.decode(list(ids))
    eot = template.end_of_turn
    return text.split(eot, 1)[0] if eot else text


def chat_replies(gen: Generator, template: ChatTemplate, encoder: Encoder, prompts: Sequence[str], *,
                 max_new_tokens: int = 64, sampling: Sampling = GREEDY,
                 system: str | None = None, stop_ids: Sequence[int] = ()) -> tuple[list[str], GenerationResult]:
    """The reply to each prompt (one user turn, after an optional system message), batched;
    `stop_ids` end a reply too (beside the end-of-turn id)."""
    head = [{"role": "system", "content": system}] if system else []
    ids = [encode_chat_prompt(template, encoder, [*head, {"role": "user", "content": p}]).tolist() for p in prompts]
    eot = end_of_turn_ids(template, encoder).tolist()
    one = eot if len(eot) == 1 else []  # one id: a stop id; several (byte-level): a stop sequence
    result = gen.generate(ids, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=[*stop_ids, *one],
                          stop_sequence=eot if len(eot) > 1 else ())
    return [reply_text(template, encoder, row) for row in result.tokens], result
