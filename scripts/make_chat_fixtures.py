"""Chat-template fixtures for tests/test_chat_template.py: three tokenizer directories and what
transformers makes of multi-turn conversations with them (no network).

Run with the fixture venv (transformers + tokenizers; the test suite itself never imports them):

    python scripts/make_chat_fixtures.py     # writes tests/fixtures/chat/<name>/

Each `tests/fixtures/chat/<name>/` holds `tokenizer.json` (a small byte-level BPE trained here on
a few sentences, with the template's special tokens added as special tokens),
`tokenizer_config.json` (with the `chat_template`) and `expected.json`:
- `llama3`: the Llama-3 Instruct template (<|begin_of_text|>, <|start_header_id|>,
  <|end_header_id|>, <|eot_id|>; contents are `| trim`med);
- `qwen`: the Qwen2.5 (ChatML) template with its default system prompt and tool turns;
- `generation`: a ChatML-like template with `{% generation %}` around each assistant content
  and its <|im_end|> (HF's documented way of marking assistant tokens), special tokens stored as
  AddedToken dicts.
For each conversation expected.json stores transformers' rendered text
(`apply_chat_template(tokenize=False)`), its ids (`tokenize=True, return_dict=True`), the
assistant mask and the mask of the last assistant turn. Where the template marks generations the
mask is transformers' own (`return_assistant_tokens_mask=True`). Where it does not, the mask is
computed here, independently of jaxinfra's code: each assistant content starts where transformers'
rendering of the conversation before it with `add_generation_prompt=True` ends; the content (as
the template writes it: stripped for Llama-3) plus the template's end-of-turn token is mapped to
tokens with transformers' `token_to_chars` (every token overlapping it, as transformers 5 marks
generation blocks). Also stored: the ids of one user turn with the
generation prompt, and one conversation truncated by transformers (`truncation=True,
max_length=N`).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import tokenizers
import transformers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "chat"

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are \
provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": \
<args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

GENERATION = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
            {{- message['content'] + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

FIXTURES = {
    "llama3": dict(template=LLAMA3, end_of_turn="<|eot_id|>",
                   special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                            "<|eot_id|>"],
                   config={"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}),
    "qwen": dict(template=QWEN, end_of_turn="<|im_end|>", special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                 config={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "generation": dict(template=GENERATION, end_of_turn="<|im_end|>",
                       special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                       config={"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}),
}

CONVERSATIONS = {
    "multi_turn": [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "The capital of Italy is Rome."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome."},
    ],
    "unicode": [
        {"role": "user", "content": "Ça va? Écris «bonjour» en japonais 🙂"},
        {"role": "assistant", "content": "こんにちは — très bien, merci! 🚀"},
    ],
    "tool": [
        {"role": "system", "content": "You can use a calculator."},
        {"role": "user", "content": "What is 6 times 7?"},
        {"role": "assistant", "content": "Let me compute that."},
        {"role": "tool", "content": "42"},
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": "6 times 7 is 42."},
    ],
    "empty_and_spaces": [
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "  Now say hi, with spaces around.  "},
        {"role": "assistant", "content": "  hi there \n"},
    ],
    "special_text_in_user": [
        {"role": "user", "content": "What does <|im_end|> or <|eot_id|> mean in a prompt?"},
        {"role": "assistant", "content": "It ends a turn."},
    ],
    "no_assistant": [
        {"role": "user", "content": "Hello?"},
    ],
}
PROMPT = [{"role": "user", "content": "What is the capital of Spain?"}]
TRUNCATED = "multi_turn"  # truncated 3 tokens into its first assistant turn

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.",
    "You answer in one short sentence. You are welcome. Thanks! Hello? Say nothing. Now say hi.",
    "What is 6 times 7? Let me compute that. 6 times 7 is 42. You can use a calculator.",
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant. It ends a turn.",
    "user assistant system tool what does this mean in a prompt? hi there, with spaces around.",
    "Ça va? Écris bonjour en japonais. こんにちは très bien, merci!",
]


def train_tokenizer(special: list[str], name: str) -> tokenizers.Tokenizer:
    """A byte-level BPE (as Llama-3 and Qwen use) with the template's tokens as special tokens."""
    tok = tokenizers.Tokenizer(models.BPE())
    if name == "qwen":
        tok.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
    if name == "llama3":  # Llama-3's split: a regex, then byte-level without its own regex
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(r"\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+|\s+"), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def write_tokenizer_dir(name: str, spec: dict) -> pathlib.Path:
    """tokenizer.json + tokenizer_config.json (chat_template inside it, as transformers 4 stored it)."""
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(spec["special"], name),
                                                **spec["config"])
    with tempfile.TemporaryDirectory() as tmp:
        fast.save_pretrained(tmp)
        shutil.copy(os.path.join(tmp, "tokenizer.json"), out / "tokenizer.json")
        config = json.loads(pathlib.Path(tmp, "tokenizer_config.json").read_text())
    config["chat_template"] = spec["template"]
    if name == "generation":  # special tokens as AddedToken dicts, as many Hub configs store them
        for key in ("bos_token", "eos_token"):
            config[key] = {"__type": "AddedToken", "content": config[key], "lstrip": False, "normalized": False,
                           "rstrip": False, "single_word": False, "special": True}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return out


def reference_spans(tok, messages: list[dict], text: str, end_of_turn: str, strip: bool) -> list[tuple[int, int]]:
    """Each assistant turn's content + end-of-turn characters, found from transformers' renderings of
    the conversation before it (with the generation prompt): the content starts where that ends."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        assert text.startswith(prefix), (i, prefix, text)
        content = m["content"].strip() if strip else m["content"]
        start = len(prefix)
        assert text[start:].startswith(content + end_of_turn), (i, text[start:])
        spans.append((start, start + len(content) + len(end_of_turn)))
    return spans


def token_mask(encoding, n: int, spans: list[tuple[int, int]]) -> list[int]:
    """Tokens whose characters (transformers' token_to_chars) overlap a span. Not char_to_token per
    character: it names only the first token of a character, and a byte-level BPE splits a
    multi-byte character into several tokens that all carry it (transformers 5 marks them all)."""
    mask = [0] * n
    for t in range(n):
        chars = encoding.token_to_chars(t)
        if chars is not None and any(chars.start < end and chars.end > start for start, end in spans):
            mask[t] = 1
    return mask


def conversation_record(tok, spec: dict, name: str, messages: list[dict], has_generation: bool) -> dict:
    text = tok.apply_chat_template(messages, tokenize=False)
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=has_generation)
    ids = list(out["input_ids"])
    encoding = tok(text, add_special_tokens=False)
    assert encoding["input_ids"] == ids
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if has_generation:
        mask = list(out["assistant_masks"])
        last_start = (len(tok.apply_chat_template(messages[:assistant[-1]], tokenize=False, add_generation_prompt=True))
                      if assistant else len(text))
        last = [int(m and encoding.token_to_chars(t).start >= last_start) for t, m in enumerate(mask)]
    else:
        spans = reference_spans(tok, messages, text, spec["end_of_turn"], strip=name == "llama3")
        mask = token_mask(encoding, len(ids), spans)
        last = token_mask(encoding, len(ids), spans[-1:])
    return {"messages": messages, "text": text, "input_ids": ids, "assistant_mask": mask, "last_assistant_mask": last}


def truncated_record(tok, spec: dict, name: str, has_generation: bool, record: dict) -> dict:
    conversation, max_length = TRUNCATED, record["assistant_mask"].index(1) + 3
    out = tok.apply_chat_template(CONVERSATIONS[conversation], tokenize=True, return_dict=True, truncation=True,
                                  max_length=max_length, return_assistant_tokens_mask=has_generation)
    ids = list(out["input_ids"])
    mask = list(out["assistant_masks"]) if has_generation else record["assistant_mask"][:len(ids)]
    assert len(ids) == max_length and ids == record["input_ids"][:max_length]
    assert mask == record["assistant_mask"][:max_length]
    return {"conversation": conversation, "max_length": max_length, "input_ids": ids, "assistant_mask": mask}


def make(name: str, spec: dict) -> None:
    out = write_tokenizer_dir(name, spec)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template == spec["template"]
    has_generation = "{% generation %}" in spec["template"] or "{%- generation %}" in spec["template"]
    records = {c: conversation_record(tok, spec, name, m, has_generation) for c, m in CONVERSATIONS.items()}
    prompt = tok.apply_chat_template(PROMPT, tokenize=True, return_dict=True, add_generation_prompt=True)
    expected = {
        "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
        "has_generation": has_generation, "end_of_turn": spec["end_of_turn"],
        "special_tokens": tok.special_tokens_map,
        "conversations": records,
        "prompt": {"messages": PROMPT, "text": tok.apply_chat_template(PROMPT, tokenize=False,
                                                                       add_generation_prompt=True),
                   "input_ids": list(prompt["input_ids"])},
        "truncated": truncated_record(tok, spec, name, has_generation, records[TRUNCATED]),
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    sizes = {p.name: p.stat().st_size for p in out.iterdir()}
    print(name, sizes, {c: (len(r["input_ids"]), sum(r["assistant_mask"])) for c, r in records.items()})


def main() -> None:
    for name, spec in FIXTURES.items():
        make(name, spec)


if __name__ == "__main__":
    main()
