"""Chat templates (jaxinfra/data/chat.py): rendering and the assistant mask against transformers'
output stored by scripts/make_chat_fixtures.py (tests/fixtures/chat/), and the built-in ChatML on
byte-level ids against hand-written expectations. No torch, no transformers: jinja2 and tokenizers."""

from __future__ import annotations

import functools
import json
import pathlib
import pickle

import numpy as np
import pytest

from jaxinfra.data import chat
from jaxinfra.data.chat import ASSISTANT, LAST_ASSISTANT, NOT_TRAINED, encode_chat, load_chat_template
from jaxinfra.data.config import DataError
from jaxinfra.data.encode import make_encoder

BYTES = make_encoder(None)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Héllo"},
    {"role": "assistant", "content": "Hï!"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "ok"},
]
CHATML_TEXT = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHéllo<|im_end|>\n"
               "<|im_start|>assistant\nHï!<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n"
               "<|im_start|>assistant\nok<|im_end|>\n")


def _text(ids: np.ndarray) -> str:
    return bytes(ids.astype(np.uint8)).decode("utf-8")


def test_constants():
    assert chat.ROLES == ("system", "user", "assistant", "tool")
    assert (NOT_TRAINED, ASSISTANT, LAST_ASSISTANT) == (0, 1, 2)


def test_chatml_bytes_render_and_mask():
    template = load_chat_template("chatml", None)
    assert template.end_of_turn == "<|im_end|>" and not template.has_generation
    assert _text(chat.end_of_turn_ids(template, BYTES)) == "<|im_end|>"
    ids, codes = encode_chat(template, BYTES, CONVERSATION)
    assert ids.dtype == np.int32 and codes.dtype == np.uint8 and ids.shape == codes.shape
    assert _text(ids) == CHATML_TEXT  # no end-of-document id for chat
    # Each assistant content plus its <|im_end|>; the multi-byte "ï" is marked on both its bytes.
    assert _text(ids[codes == ASSISTANT]) == "Hï!<|im_end|>"
    assert _text(ids[codes == LAST_ASSISTANT]) == "ok<|im_end|>"
    first = CHATML_TEXT.encode().index("Hï!".encode())
    assert list(codes[first - 1:first + 5]) == [0, 1, 1, 1, 1, 1]


def test_chatml_prompt_and_empty_assistant():
    template = load_chat_template("chatml", None)
    prompt = chat.encode_chat_prompt(template, BYTES, [{"role": "user", "content": "2+2?"}])
    assert _text(prompt) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids, codes = encode_chat(template, BYTES, [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}])
    assert _text(ids[codes == LAST_ASSISTANT]) == "<|im_end|>"  # an empty reply trains its end of turn
    ids, codes = encode_chat(template, BYTES, [{"role": "user", "content": "no reply"}])
    assert not codes.any()


def test_messages_of():
    assert chat.messages_of({"prompt": "a", "response": "b"}, "f:1") == [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    row = {"messages": [{"role": "tool", "content": "42", "name": "calc"}]}
    assert chat.messages_of(row, "f:2") == [{"role": "tool", "content": "42"}]
    for row, match in [({"messages": [{"role": "robot", "content": "x"}]}, "f:3: message 0 has unknown role 'robot'"),
                       ({"messages": [{"role": "user"}]}, "f:3: message 0 .user. has no content"),
                       ({"messages": [{"role": "user", "content": 5}]}, "non-string content"),
                       ({"messages": []}, "no messages"),
                       ({"text": "x"}, "no 'messages'")]:
        with pytest.raises(DataError, match=match):
            chat.messages_of(row, "f:3")


FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "chat"
NAMES = ("llama3", "qwen", "generation")


@functools.cache
def _fixture(name: str):
    """(template, encoder, expected.json) of tests/fixtures/chat/<name> (scripts/make_chat_fixtures.py)."""
    pytest.importorskip("tokenizers")
    tokenizer = str(FIXTURES / name / "tokenizer.json")
    expected = json.loads((FIXTURES / name / "expected.json").read_text())
    return load_chat_template("tokenizer", tokenizer), make_encoder(tokenizer), expected


@pytest.mark.parametrize("name", NAMES)
def test_fixture_template(name):
    template, encoder, expected = _fixture(name)
    assert template.has_generation == expected["has_generation"]
    assert template.end_of_turn == expected["end_of_turn"]  # read from the template, not eos_token
    assert dict(template.special_tokens) == expected["special_tokens"]
    eot = chat.end_of_turn_ids(template, encoder)
    assert len(eot) == 1 and encoder.decode(eot) == expected["end_of_turn"]  # one special token


@pytest.mark.parametrize("name", NAMES)
def test_fixture_ids_and_mask_equal_transformers(name):
    template, encoder, expected = _fixture(name)
    for conversation, want in expected["conversations"].items():
        assert chat.render(template, want["messages"])[0] == want["text"], conversation
        ids, codes = encode_chat(template, encoder, want["messages"], conversation)
        assert ids.tolist() == want["input_ids"], conversation
        assert (codes > 0).astype(int).tolist() == want["assistant_mask"], conversation
        assert (codes == LAST_ASSISTANT).astype(int).tolist() == want["last_assistant_mask"], conversation
        assert set(np.unique(codes)) <= {NOT_TRAINED, ASSISTANT, LAST_ASSISTANT}


@pytest.mark.parametrize("name", NAMES)
def test_fixture_prompt_and_truncation(name):
    template, encoder, expected = _fixture(name)
    prompt = expected["prompt"]
    assert chat.encode_chat_prompt(template, encoder, prompt["messages"]).tolist() == prompt["input_ids"]
    # The data source truncates a conversation longer than seq_len + 1 by slicing its encoding:
    # that equals transformers' own truncation (truncation=True, max_length=seq_len + 1).
    cut = expected["truncated"]
    n = cut["max_length"]
    ids, codes = encode_chat(template, encoder, expected["conversations"][cut["conversation"]]["messages"])
    assert len(ids) > n
    assert ids[:n].tolist() == cut["input_ids"]
    assert (codes[:n] > 0).astype(int).tolist() == cut["assistant_mask"]
    assert codes[n - 1] > 0  # the cut falls inside an assistant turn


def test_template_file_with_generation_blocks_on_bytes(tmp_path):
    path = tmp_path / "gen.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}]{% if m.role == 'assistant' %}{% generation %}"
                    "{{ m.content }}</s>{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}")
    template = load_chat_template(str(path), None)
    assert template.has_generation and template.origin == str(path) and template.end_of_turn == "</s>"
    assert pickle.loads(pickle.dumps(template)) == template  # grain workers receive it
    ids, codes = encode_chat(template, BYTES, CONVERSATION[1:])
    assert _text(ids) == "[user]Héllo[assistant]Hï!</s>[user]again[assistant]ok</s>"  # trim_blocks ate the \n
    assert _text(ids[codes == ASSISTANT]) == "Hï!</s>" and _text(ids[codes == LAST_ASSISTANT]) == "ok</s>"


def test_errors(tmp_path):
    bad_role = [{"role": "robot", "content": "x"}]
    with pytest.raises(DataError, match=r"^c.jsonl:3: message 0 has unknown role 'robot'"):
        encode_chat(load_chat_template("chatml", None), BYTES, bad_role, "c.jsonl:3")
    raising = tmp_path / "raising.jinja"
    raising.write_text("{% for m in messages %}\n{% if m.role == 'system' %}\n"
                       "{{ raise_exception('System role not supported') }}\n{% endif %}{{ m.content }}{% endfor %}")
    template = load_chat_template(str(raising), None)
    with pytest.raises(DataError) as e:
        encode_chat(template, BYTES, CONVERSATION, "c.jsonl:7")
    assert str(e.value).startswith("c.jsonl:7: chat template ") and "\n" not in str(e.value)
    assert "TemplateError at template line 3: System role not supported" in str(e.value)
    unknown_filter = tmp_path / "filter.jinja"
    unknown_filter.write_text("{% for m in messages %}\n{{ m.content | shout }}{% endfor %}")
    with pytest.raises(DataError, match=r"template line 2: No filter named 'shout'"):
        load_chat_template(str(unknown_filter), None)
    with pytest.raises(DataError, match="no such template file"):
        load_chat_template(str(tmp_path / "missing.jinja"), None)
    with pytest.raises(DataError, match=r"needs data\.tokenizer"):
        load_chat_template("tokenizer", None)
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text((FIXTURES / "qwen" / "tokenizer.json").read_text())
    with pytest.raises(DataError, match=r"there is no .*tokenizer_config.json'"):
        load_chat_template("tokenizer", str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    with pytest.raises(DataError, match=r"tokenizer_config.json' has no 'chat_template'"):
        load_chat_template("tokenizer", str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(chat.CHATML)  # where transformers 5 saves it
    assert load_chat_template("tokenizer", str(folder / "tokenizer.json")).source == chat.CHATML


def test_end_of_turn_falls_back_to_eos_token(tmp_path):
    # Llama-2 writes " " + eos_token after a reply: the end of turn is eos_token (from the
    # tokenizer config beside the tokenizer), the space before it is marked with it.
    (tmp_path / "tokenizer.json").write_text((FIXTURES / "llama3" / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": {"content": "</s>"}}')
    (tmp_path / "llama2.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'user' %}{{ bos_token + '[INST] ' + m.content.strip() + ' [/INST]' }}"
        "{% elif m.role == 'assistant' %}{{ ' ' + m.content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
    template = load_chat_template(str(tmp_path / "llama2.jinja"), str(tmp_path / "tokenizer.json"))
    assert template.end_of_turn == "</s>" and template.token("bos_token") == "<s>"
    ids, codes = encode_chat(template, BYTES, CONVERSATION[1:])
    assert _text(ids) == "<s>[INST] Héllo [/INST] Hï! </s><s>[INST] again [/INST] ok </s>"
    assert _text(ids[codes == ASSISTANT]) == "Hï! </s>" and _text(ids[codes == LAST_ASSISTANT]) == "ok </s>"
