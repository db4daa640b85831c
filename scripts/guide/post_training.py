"""Page 21 of the guide (post-training): the data files of its runs, the SFT loss mask, LoRA's counts.

    python scripts/guide/post_training.py data OUT    # writes OUT/{chat,prefs,prompts}.jsonl and OUT/rewards.py,
                                                      # prints one conversation's loss mask and token counts
    python scripts/guide/post_training.py lora        # trainable parameters: LoRA vs full fine-tuning

The task is jaxinfra/sft/tasks.py's `capitals_chat` ("Write xlimt in capitals" -> "XLIMT"). The
preference pairs prefer the capitals reply to the word copied as it is; the GRPO prompts carry the
capitals as their `answer`, scored by `word_letters` in OUT/rewards.py.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from jaxinfra.config import load_config
from jaxinfra.data.chat import encode_chat, load_chat_template, render
from jaxinfra.data.encode import make_encoder
from jaxinfra.metrics.flops import param_counts
from jaxinfra.metrics.table import Column, format_table
from jaxinfra.sft.tasks import answer, capitals_chat, prompt, write_jsonl
from models.lora_config import adapter_param_count

# A verifiable reward with partial credit, so that a barely trained policy gets different rewards
# within a group (GRPO learns nothing from a group whose rewards are all equal); over the longer
# length, so that a reply padded with letters does not pay.
REWARDS = '''def word_letters(prompts, completions, answers):
    """The share of the reply's characters that are letters of the answer, over the longer of the two."""
    return [sum(ch in a for ch in c.strip()) / max(len(a), len(c.strip()), 1) for c, a in zip(completions, answers)]
'''


def trained_mask(messages: Sequence[dict]) -> tuple[str, list[int], list[int]]:
    """The ChatML rendering of a conversation, its byte ids and their role codes (0 = not trained)."""
    template = load_chat_template("chatml", None)
    ids, codes = encode_chat(template, make_encoder(None), messages)
    text, _ = render(template, messages)
    return text, [int(i) for i in ids], [int(c) for c in codes]


def show_mask(text: str, codes: Sequence[int]) -> str:
    """The text with the trained bytes in [brackets] (byte-level: one id per byte; ASCII here)."""
    out, inside = [], False
    for ch, code in zip(text, codes, strict=True):
        if bool(code) != inside:
            out.append("[" if code else "]")
            inside = bool(code)
        out.append(ch.replace("\n", "\\n"))
    return "".join(out) + ("]" if inside else "")


def preference_rows(rows: Sequence[dict]) -> list[dict]:
    """Pairs that prefer the rule (capitals) to copying the word unchanged."""
    out = []
    for row in rows:
        word = answer(row).lower()
        out.append({"prompt": prompt(row), "chosen": word.upper(), "rejected": word})
    return out


def cmd_data(out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    train, held = capitals_chat(2000, seed=0)
    write_jsonl(train, out / "chat.jsonl")
    pairs = preference_rows(capitals_chat(2000, seed=1)[0])
    (out / "prefs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    prompts = [{"prompt": [{"role": "user", "content": prompt(r)}], "answer": answer(r)} for r in held]
    (out / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (out / "rewards.py").write_text(REWARDS)
    print(f"wrote {out}/chat.jsonl ({len(train)} conversations), prefs.jsonl ({len(pairs)} pairs), "
          f"prompts.jsonl ({len(prompts)} prompts), rewards.py")
    print("first conversation:", json.dumps(train[0]))
    text, ids, codes = trained_mask(train[0]["messages"])
    print("ChatML, trained bytes in [brackets]:", show_mask(text, codes))
    trained = sum(c > 0 for c in codes)
    reply = answer(train[0])
    print(f"ids {len(ids)}, trained {trained} = {len(reply)} reply + {trained - len(reply)} end-of-turn "
          f"('<|im_end|>'), not trained {len(ids) - trained}")


def lora_rows(presets: Sequence[str], settings: Sequence[tuple[int, str]]) -> list[list[object]]:
    """[preset, rank, targets, LoRA trainable, full trainable, share] from the stack's own counts."""
    rows = []
    for preset in presets:
        for rank, targets in settings:
            cfg = load_config(preset, [f"lora.rank={rank}", f"lora.targets=[{targets}]"])
            lora = adapter_param_count(cfg.model, cfg.lora)
            full = param_counts(cfg.model)["total"]
            rows.append([preset, rank, targets, lora, full, f"{100 * lora / full:.2f}%"])
    return rows


def cmd_lora() -> None:
    rows = lora_rows(("tiny", "llama3-8b"), ((8, "q,k,v,o"), (16, "q,k,v,o,gate,up,down")))
    print(format_table(rows, [Column("preset"), Column("rank", align=">"), Column("targets"),
                              Column("LoRA trains", ",", ">"), Column("full trains", ",", ">"),
                              Column("share", align=">")]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("data").add_argument("out", type=pathlib.Path)
    sub.add_parser("lora")
    args = parser.parse_args()
    cmd_data(args.out) if args.cmd == "data" else cmd_lora()


if __name__ == "__main__":
    main()
