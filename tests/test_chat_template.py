"""Chat templates (jaxinfra/data/chat.py): rendering and the assistant mask against transformers'
output stored by scripts/make_chat_fixtures.py (tests/fixtures/chat/), and the built-in ChatML on
byte-level ids against hand-written expectations. No torch, no transformers: jinja2 and tokenizers."""

from __future__ import annotations

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
