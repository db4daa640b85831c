"""Chat conversations -> token ids and a per-token role code, rendered as Hugging Face does.

    template = load_chat_template("tokenizer", "model/tokenizer.json")   # or "chatml", or a .jinja path
    ids, codes = encode_chat(template, encoder, messages_of(row, "chat.jsonl:12"), "chat.jsonl:12")
    prompt_ids = encode_chat_prompt(template, encoder, [{"role": "user", "content": "Hi"}])

Rendering follows transformers' `apply_chat_template`: a Jinja2 ImmutableSandboxedEnvironment with
`trim_blocks` and `lstrip_blocks`, the loop-control extension, HF's `tojson` filter (no HTML
escaping, `ensure_ascii=False`), the globals `raise_exception`, `strftime_now`, `dict` and
`namespace`, the `{% generation %}` block, and the variables `messages`, `tools` (None),
`documents` (None), `add_generation_prompt` and the named special tokens of
`tokenizer_config.json` (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`,
`cls_token`, `mask_token`; a string or an AddedToken dict's `content`). The rendered text is
tokenized once: byte-level, ids are its UTF-8 bytes (no end-of-document id for chat); with a
tokenizer.json, `tokenizers` encodes it with add_special_tokens=False, so special tokens written in
the text become their ids exactly as HF's fast tokenizer makes them.

Assistant mask (role codes: 0 not trained, 1 assistant, 2 the conversation's last assistant turn):
- a template with `{% generation %}...{% endgeneration %}` blocks: the tokens that
  `apply_chat_template(..., return_assistant_tokens_mask=True)` marks, i.e. every token whose
  character span overlaps the text a generation block rendered; code 2 on the last block's tokens;
- a template without them: for each assistant message, the characters of its content in the
  rendered text plus the template's end-of-turn text (`ChatTemplate.end_of_turn`, e.g.
  "<|im_end|>", "<|eot_id|>") when it is the next occurrence before the following message's
  content; every token overlapping those characters is marked (the same overlap rule). The
  content is located by rendering once more with private-use markers around each message's
  content (then around each stripped content, for templates that `| trim` it) and keeping the
  marked spans when the marked render, markers removed, equals the plain one; otherwise each
  content (then its stripped form) is searched in order in the rendered text, and an assistant
  content the template does not write verbatim is a DataError (use `{% generation %}` blocks).
  An empty assistant content marks its end-of-turn token only.
- `end_of_turn` is read from the template itself: a probe conversation (user, assistant) is
  rendered and the text right after the assistant content is taken: the longest special token
  of the tokenizer config it starts with, else its run of non-space characters, else eos_token
  (e.g. Llama-2's " </s>": eos_token, and the space before it is marked too).
The template: "chatml" (built in, transformers' old default ChatML), "tokenizer" (found as
transformers loads it: chat_template.jinja beside the tokenizer.json, additional_chat_templates/
default.jinja, else tokenizer_config.json's `chat_template`), or a Jinja file. Messages carry
role and content only (tool calls and other fields are not read from the data).
Byte-level, a character's bytes are all marked together (a multi-byte character is several ids).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import traceback
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

import numpy as np

from jaxinfra.data.config import DataError
from jaxinfra.data.encode import Encoder

ROLES = ("system", "user", "assistant", "tool")
NOT_TRAINED = 0
ASSISTANT = 1
LAST_ASSISTANT = 2

# The ChatML template transformers shipped as its default (its `default_chat_template`).
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")  # HF's own test for generation markers
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use markers around contents (located spans)
_PROBE = "\ue002"  # private-use content of the end-of-turn probe


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template and what rendering it needs; plain strings, so it pickles to grain workers."""

    source: str  # the Jinja text
    origin: str  # "chatml", "tokenizer:<tokenizer_config.json path>" or the template file's path
    special_tokens: tuple[tuple[str, str], ...] = ()  # (name, text): bos_token, eos_token, ...
    end_of_turn: str = ""  # the text that ends an assistant turn ("" when the template has none)

    @property
    def has_generation(self) -> bool:
        """Whether the template marks assistant text with {% generation %} blocks."""
        return bool(_GENERATION.search(self.source))

    def token(self, name: str) -> str | None:
        return dict(self.special_tokens).get(name)


# ---------------------------------------------------------------- rows -> messages


def messages_of(row: Mapping, where: str) -> list[dict[str, str]]:
    """The conversation of a data row: its `messages` ({role, content} dicts) or `prompt`/`response`."""
    if "messages" in row and row["messages"] is not None:
        raw = row["messages"]
        if isinstance(raw, str) or not isinstance(raw, Sequence):
            raise DataError(f"{where}: 'messages' must be a list of {{role, content}} objects, got "
                            f"{type(raw).__name__}")
        messages = [_message(m, where, i) for i, m in enumerate(raw)]
    elif "prompt" in row and "response" in row:
        messages = [_message({"role": "user", "content": row["prompt"]}, where, "prompt"),
                    _message({"role": "assistant", "content": row["response"]}, where, "response")]
    else:
        raise DataError(f"{where}: no 'messages' and no 'prompt'/'response' columns (keys: {sorted(row)[:8]})")
    if not messages:
        raise DataError(f"{where}: the conversation has no messages")
    return messages


def _message(m: object, where: str, index: int | str) -> dict[str, str]:
    if not isinstance(m, Mapping):
        raise DataError(f"{where}: message {index} is a {type(m).__name__}, not a {{role, content}} object")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise DataError(f"{where}: message {index} has unknown role {role!r} (one of {list(ROLES)})")
    if not isinstance(content, str):
        what = "no content" if content is None else f"a non-string content ({type(content).__name__})"
        raise DataError(f"{where}: message {index} ({role}) has {what}")
    return {"role": role, "content": content}


# ---------------------------------------------------------------- loading templates


def load_chat_template(spec: str, tokenizer: str | None) -> ChatTemplate:
    """The template `spec` names: "chatml" (built in), "tokenizer" (the chat template stored beside
    the tokenizer.json `tokenizer`) or a Jinja file; DataError on any problem."""
    config = _tokenizer_config(tokenizer, required=spec == "tokenizer")
    if spec == "chatml":
        source, origin = CHATML, "chatml"
    elif spec == "tokenizer":
        source, origin = _stored_template(config, tokenizer)
    else:
        source, origin = _read_template_file(spec), spec
    specials = tuple((name, text) for name in SPECIAL_TOKEN_NAMES
                     if (text := _token_text((config or {}).get(name))) is not None)
    template = ChatTemplate(source, origin, specials)
    _compiled(source, origin)  # a syntax error surfaces at load time
    controls = _control_tokens(config or {}, tokenizer)
    return dataclasses.replace(template, end_of_turn=_derive_end_of_turn(template, controls))


def _tokenizer_config(tokenizer: str | None, required: bool) -> dict | None:
    if tokenizer is None:
        if required:
            raise DataError("data.chat_template=tokenizer needs data.tokenizer (the tokenizer.json whose "
                            "tokenizer_config.json holds the template)")
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(tokenizer)), "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {path!r}: {e}") from e
    if not isinstance(config, dict):
        raise DataError(f"{path!r}: not a JSON object")
    return config


def _stored_template(config: dict | None, tokenizer: str | None) -> tuple[str, str]:
    """The default template as transformers loads it: chat_template.jinja beside the tokenizer
    (transformers 5 saves it there), else additional_chat_templates/default.jinja, else
    tokenizer_config.json's `chat_template` (a string, or a list of {name, template})."""
    folder = os.path.dirname(os.path.abspath(str(tokenizer)))
    for name in ("chat_template.jinja", os.path.join("additional_chat_templates", "default.jinja")):
        if os.path.isfile(path := os.path.join(folder, name)):
            return _read_template_file(path), path
    config_path = os.path.join(folder, "tokenizer_config.json")
    found = (config or {}).get("chat_template")
    if isinstance(found, list):
        found = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}.get("default")
    if isinstance(found, dict):
        found = found.get("default")
    if isinstance(found, str) and found:
        return found, f"tokenizer:{config_path}"
    what = f"{config_path!r} has no 'chat_template'" if config is not None else f"there is no {config_path!r}"
    raise DataError(f"data.chat_template=tokenizer: {what} (and no chat_template.jinja beside it); give "
                    "data.chat_template=chatml or a Jinja file")


def _read_template_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise DataError(f"data.chat_template: no such template file {path!r} (values: tokenizer, chatml "
                        "or a path to a Jinja file)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"data.chat_template: cannot read {path!r}: {e}") from e


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _control_tokens(config: dict, tokenizer: str | None) -> tuple[str, ...]:
    """Special-token texts an end of turn may be: the named ones and the added special tokens."""
    out = {t for name in SPECIAL_TOKEN_NAMES if (t := _token_text(config.get(name)))}
    for token in (config.get("added_tokens_decoder") or {}).values():
        if isinstance(token, dict) and token.get("special") and _token_text(token):
            out.add(_token_text(token))
    if tokenizer is not None and os.path.isfile(tokenizer):
        with contextlib.suppress(OSError, ValueError):
            with open(tokenizer, encoding="utf-8") as f:
                added = json.load(f).get("added_tokens") or []
            out.update(t["content"] for t in added if isinstance(t, dict) and t.get("special")
                       and isinstance(t.get("content"), str))
    out.add("<|im_end|>")  # ChatML's, for byte-level templates that have no tokenizer config
    return tuple(sorted((t for t in out if t), key=len, reverse=True))


def _derive_end_of_turn(template: ChatTemplate, controls: Sequence[str]) -> str:
    """What the template writes right after an assistant message's content (see the module doc)."""
    probes = ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}],
              [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": _PROBE}])
    for messages in probes:
        try:
            text, _ = render(template, messages)
        except DataError:
            continue
        if _PROBE in text:
            after = text[text.rindex(_PROBE) + 1:]
            for token in controls:
                if after.startswith(token):
                    return token
            run = re.match(r"\S+", after)
            if run:
                return run.group(0)
            break
    return template.token("eos_token") or ""


# ---------------------------------------------------------------- Jinja environment


# The render's _Tracking travels in the template's own context under this name (not in a global
# or context variable: a render's state stays with its call).
_TRACKING = "_jaxinfra_generation_tracking"


class _Tracking:
    """Characters emitted so far by the template and the generation blocks' (start, end) spans."""

    def __init__(self) -> None:
        self.position = 0
        self.spans: list[tuple[int, int]] = []


@functools.lru_cache(maxsize=16)
def _compiled(source: str, origin: str) -> Any:
    """The compiled template (per process; the sandbox and its extension built once per source)."""
    import jinja2

    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as e:
        raise DataError(f"chat template {origin}: {_jinja_error(e)}") from None


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_extension(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _namespace_class()
    return env


def _generation_extension() -> type:
    """`{% generation %}...{% endgeneration %}`: renders its body and, while a render is tracked,
    records the body's character span (the characters emitted before it + its length), as HF's
    AssistantTracker does."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_track", [nodes.ContextReference()])
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _track(self, context: Any, caller: Any) -> str:
            text = caller()
            tracking = context.get(_TRACKING)
            if tracking is not None:
                tracking.spans.append((tracking.position, tracking.position + len(text)))
            return text

    return Generation


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # HF's filter: Jinja's own tojson escapes HTML characters, which chat templates must not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


class _TemplateDict:
    """`dict(...)` for templates without the type itself (no attribute escapes), as HF exposes it."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


@functools.lru_cache(maxsize=1)
def _namespace_class() -> type:
    import jinja2
    import jinja2.utils

    def check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    class TemplateNamespace(jinja2.utils.Namespace):
        # A namespace that refuses underscore names (no route to CPython internals), as HF's.
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return TemplateNamespace


def _jinja_error(e: BaseException) -> str:
    """The Jinja error in one line, with the template line it happened on."""
    line = getattr(e, "lineno", None)
    if line is None:  # runtime errors: Jinja maps the template's frames to "<template>" lines
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == "<template>"]
        line = frames[-1].lineno if frames else None
    message = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__} at template line {line}: {message}" if line else f"{type(e).__name__}: {message}"


# ---------------------------------------------------------------- rendering and encoding


def render(template: ChatTemplate, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False,
           where: str = "") -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans of its generation blocks; DataError (with the
    Jinja error's template line) when the template fails."""
    compiled = _compiled(template.source, template.origin)
    tracking = _Tracking()
    pieces: list[str] = []
    try:
        for piece in compiled.generate(messages=[dict(m) for m in messages], tools=None, documents=None,
                                       add_generation_prompt=add_generation_prompt, **dict(template.special_tokens),
                                       **{_TRACKING: tracking}):
            pieces.append(piece)
            tracking.position += len(piece)
    except Exception as e:  # noqa: BLE001 - the template is user code: every failure is a data problem
        prefix = f"{where}: " if where else ""
        raise DataError(f"{prefix}chat template {template.origin} failed: {_jinja_error(e)}") from None
    return "".join(pieces), tracking.spans


def encode_chat(template: ChatTemplate, encoder: Encoder, messages: Sequence[Mapping[str, str]],
                where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """The conversation's token ids (int32) and one role code per id (uint8; see the module doc)."""
    _check_roles(messages, where)
    text, generation = render(template, messages, where=where)
    spans = generation if template.has_generation else _assistant_spans(template, messages, text, where)
    ids, offsets = _tokenize(encoder, text)
    codes = np.zeros(len(ids), np.uint8)
    for k, (start, end) in enumerate(spans):
        code = LAST_ASSISTANT if k == len(spans) - 1 else ASSISTANT
        codes[_overlapping(offsets, start, end)] = code
    return ids, codes


def encode_chat_prompt(template: ChatTemplate, encoder: Encoder, messages: Sequence[Mapping[str, str]]) -> np.ndarray:
    """The ids of the conversation followed by the template's generation prompt (for `generate --chat`)."""
    _check_roles(messages, "prompt")
    text, _ = render(template, messages, add_generation_prompt=True)
    return _tokenize(encoder, text)[0]


def end_of_turn_ids(template: ChatTemplate, encoder: Encoder) -> np.ndarray:
    """The ids of the template's end-of-turn text (one special token with a tokenizer.json, its
    bytes byte-level; empty when the template has none): where a chat reply stops."""
    return _tokenize(encoder, template.end_of_turn)[0]


def _check_roles(messages: Sequence[Mapping[str, str]], where: str) -> None:
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise DataError(f"{where}: message {i} has unknown role {m.get('role')!r} (one of {list(ROLES)})")


def _overlapping(offsets: np.ndarray, start: int, end: int) -> np.ndarray:
    """Tokens whose character span overlaps [start, end), as transformers marks assistant tokens:
    token_end > start and token_start < end (a zero-width token inside the span counts)."""
    return (offsets[:, 1] > start) & (offsets[:, 0] < end)


def _tokenize(encoder: Encoder, text: str) -> tuple[np.ndarray, np.ndarray]:
    """Ids (int32) of the whole text and each id's [start, end) character offsets (int64 [n, 2])."""
    if encoder.tokenizer is None:
        data = text.encode("utf-8")
        ids = np.frombuffer(data, np.uint8).astype(np.int32)
        # Each byte's character: a character's bytes all share its span.
        sizes = np.fromiter((len(c.encode("utf-8")) for c in text), np.int64, len(text))
        char_of_byte = np.repeat(np.arange(len(text), dtype=np.int64), sizes)
        return ids, np.stack([char_of_byte, char_of_byte + 1], axis=1)
    encoding = encoder._loaded().encode(text, add_special_tokens=False)
    offsets = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)
    return np.asarray(encoding.ids, np.int32), offsets


def _assistant_spans(template: ChatTemplate, messages: Sequence[Mapping[str, str]], text: str,
                     where: str) -> list[tuple[int, int]]:
    """Character spans of each assistant message's content plus its end-of-turn text."""
    contents = _content_spans(template, messages, text, where)
    out = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if contents[i] is None:  # an empty content the template rewrote: nothing to mark
            out.append((0, 0))
            continue
        start, end = contents[i]
        limit = next((s for s, _ in filter(None, contents[i + 1:])), len(text))
        if template.end_of_turn:
            found = text.find(template.end_of_turn, end, max(limit, end))
            if found >= 0:
                end = found + len(template.end_of_turn)
        out.append((start, end))
    return out


def _content_spans(template: ChatTemplate, messages: Sequence[Mapping[str, str]], text: str,
                   where: str) -> list[tuple[int, int] | None]:
    """Where each message's content sits in the rendered text: markers around each content (then
    around each stripped content, for templates that `| trim` it), else a search."""
    for strip in (False, True):
        marked = [dict(m, content=f"{_OPEN}{m['content'].strip() if strip else m['content']}{_CLOSE}")
                  for m in messages]
        try:
            marked_text, _ = render(template, marked, where=where)
        except DataError:
            continue
        plain, spans = _strip_markers(marked_text)
        if plain == text and len(spans) == len(messages):
            return list(spans)
    return _searched_spans(messages, text, where)


def _strip_markers(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without markers and each marked span in it, when every marker pairs up in order."""
    plain: list[str] = []
    spans: list[tuple[int, int]] = []
    position, start = 0, None
    for part in re.split(f"([{_OPEN}{_CLOSE}])", marked):
        if part == _OPEN:
            if start is not None:
                return "", []
            start = position
        elif part == _CLOSE:
            if start is None:
                return "", []
            spans.append((start, position))
            start = None
        else:
            plain.append(part)
            position += len(part)
    return "".join(plain), spans


def _searched_spans(messages: Sequence[Mapping[str, str]], text: str, where: str) -> list[tuple[int, int] | None]:
    """Each content (or its stripped form) searched in order; None where it cannot be found (an
    empty content is not searched: it would be found anywhere)."""
    spans: list[tuple[int, int] | None] = []
    cursor = 0
    for i, m in enumerate(messages):
        found, content = -1, m["content"]
        for candidate in dict.fromkeys((content, content.strip())):
            if candidate and (found := text.find(candidate, cursor)) >= 0:
                content = candidate
                break
        if found < 0:
            if m["role"] == "assistant" and content.strip():
                raise DataError(f"{where}: the chat template does not write assistant message {i}'s content "
                                "into the text, so its tokens cannot be found (use a template with "
                                "{% generation %} blocks)")
            spans.append(None)
            continue
        spans.append((found, found + len(content)))
        cursor = found + len(content)
    return spans
