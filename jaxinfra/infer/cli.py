"""`jaxinfra generate` and `jaxinfra eval`: thin wrappers over the jaxinfra.infer package.

    jaxinfra generate CKPT (--prompt TEXT [--chat [--system TEXT]] | --prompt-ids 1,2,3) [--max-new-tokens N]
                      [--temperature T] [--top-k K] [--top-p P] [--seed S] [--stop-ids 10,13] [--no-absorb]
                      [--kv-cache int8] [KEY=VALUE ...]
    jaxinfra eval CKPT (--tokens FILE.npy | --text FILE.txt) [--seq-len N] [--batch-size N] [KEY=VALUE ...]

CKPT is a run directory (newest readable checkpoint) or RUN/checkpoints/<step>; KEY=VALUE
overrides the run's config (e.g. mesh.tensor=2). stdout carries only the result (the text,
one JSON list of ids, or one JSON line of the eval loss); timings and logs go to stderr. With
--chat (a run trained on chat data) the prompt is one user turn rendered by the run's chat
template with the generation prompt, and stdout carries only the reply (jaxinfra/infer/chat.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from jaxinfra.compile_cache import configure as configure_compile_cache
from jaxinfra.flags import INT64, number_flag


def add_subcommands(sub: argparse._SubParsersAction,
                    extend_eval: Callable[[argparse.ArgumentParser, Any], None] | None = None) -> None:
    """`generate` and `eval`; `extend_eval(eval_parser, source_group)` may add another eval source (it then
    sets the parser's func, dispatching back to `cmd_eval` for --tokens / --text)."""
    p = sub.add_parser("generate", help="generate from a checkpoint with a KV cache (text or token ids)")
    p.add_argument("ckpt", help="run directory or RUN/checkpoints/<step>")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. mesh.tensor=2")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="text, encoded with the run's tokenizer; prints prompt + continuation")
    what.add_argument("--prompt-ids", help="comma-separated token ids; prints the generated ids as one JSON list")
    p.add_argument("--chat", action="store_true", help="--prompt is one user turn: rendered by the run's chat "
                   "template (data.chat_template) with the generation prompt; prints only the reply, which "
                   "ends at the template's end-of-turn")
    p.add_argument("--system", help="with --chat: a system message before the user turn")
    number_flag(p, "--max-new-tokens", lo=1, default=64)
    number_flag(p, "--temperature", kind=float, lo=0, note="0 = greedy", default=0.0, help="0 = greedy (default)")
    number_flag(p, "--top-k", lo=0, note="0 = off", default=0, help="sample from the k most likely ids (0 = off)")
    number_flag(p, "--top-p", kind=float, lo=0, hi=1, lo_open=True, note="1 = off", default=1.0,
                help="nucleus sampling mass (1 = off)")
    number_flag(p, "--seed", lo=INT64[0], hi=INT64[1], default=0)
    p.add_argument("--stop-ids", default=None, help="comma-separated ids that end generation (kept as the last id; "
                   "default: the eos_token_id of a generation_config.json an `hf import` carried, else none)")
    p.add_argument("--no-absorb", action="store_true", help="MLA: reconstruct K/V from the latent cache instead "
                   "of absorbing the up-projections (same result, more FLOPs)")
    p.add_argument("--kv-cache", metavar="MODE", help="int8: store the KV cache (MLA: the latent cache) as int8 with "
                   "per-token-per-head scales (as quant.kv_cache=int8); none: the compute dtype")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("eval", help="mean next-token cross-entropy of a token file, or lm-eval tasks (--tasks), "
                       "under a checkpoint")
    p.add_argument("ckpt", help="run directory or RUN/checkpoints/<step>")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokens", help=".npy integer array of token ids: [batch, seq] rows, or a flat "
                        "1-D array (as data.source=tokens reads) cut into rows of --seq-len + 1, the remainder dropped")
    source.add_argument("--text", help="a UTF-8 text file, encoded with the run's tokenizer (data.tokenizer: an "
                        "`hf import` carries the model's) and cut into rows like a 1-D --tokens file")
    number_flag(p, "--seq-len", lo=1, help="1-D token files: predictions per row (default: the run's "
                   "train.seq_len)")
    number_flag(p, "--batch-size", lo=1, default=8, help="rows per forward pass")
    p.set_defaults(func=cmd_eval)
    if extend_eval is not None:  # e.g. lm-eval tasks: another source of the same group (jaxinfra/harness/cli.py)
        extend_eval(p, source)


def _ids(text: str, what: str) -> list[int]:
    from jaxinfra.infer import InferenceError

    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise InferenceError(f"{what} must be comma-separated integers, got {text!r}") from None


def _flag_override(flag: str, key: str, value: str | None) -> list[str]:
    """`flag VALUE` as the override `key=VALUE`; a value the key does not allow is named by the flag the
    user typed (an empty one would otherwise reach the config as YAML's null)."""
    if value is None:
        return []
    from jaxinfra.config import ConfigError, apply_overrides, config_from_tree

    override = f"{key}={value}"
    try:
        config_from_tree(apply_overrides({}, [override]))  # the key's type alone: the run's config comes later
    except ConfigError as e:
        raise ConfigError(f"{flag} {value!r} sets {e}") from None
    return [override]


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxinfra.infer import Generator, InferenceError, Sampling, load_model, resolve_checkpoint, text_codec

    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    sampling.check()
    stop_ids = _ids(args.stop_ids, "--stop-ids") if args.stop_ids is not None else None
    prompt_ids = _ids(args.prompt_ids, "--prompt-ids") if args.prompt_ids is not None else None
    if prompt_ids is not None and not prompt_ids:
        raise InferenceError("--prompt-ids is empty")
    if (args.chat or args.system is not None) and args.prompt is None:
        raise InferenceError("--chat and --system take --prompt TEXT (one user turn), not --prompt-ids")
    if args.system is not None and not args.chat:
        raise InferenceError("--system needs --chat")
    overrides = list(args.overrides) + _flag_override("--kv-cache", "quant.kv_cache", args.kv_cache)
    cfg, params = load_model(args.ckpt, overrides)
    configure_compile_cache(cfg)  # the run's train.compile_cache (or an override): prefill/decode from the cache
    if stop_ids is None:
        from jaxinfra.infer.text import generation_stop_ids

        stop_ids = generation_stop_ids(cfg, resolve_checkpoint(args.ckpt)[0])
    if args.chat:
        return _generate_chat(args, cfg, params, sampling, stop_ids)
    if prompt_ids is None:
        encode, decode = text_codec(cfg, resolve_checkpoint(args.ckpt)[0])
        prompt_ids = encode(args.prompt)
        if not prompt_ids:
            raise InferenceError("--prompt encodes to no tokens")
    gen = Generator(cfg, params, absorb=not args.no_absorb)
    result = gen.generate([prompt_ids], max_new_tokens=args.max_new_tokens, sampling=sampling, stop_ids=stop_ids)
    print(f"jaxinfra generate: {result.summary()}", file=sys.stderr)
    if args.prompt_ids is not None:
        print(json.dumps(result.tokens[0]))
    else:
        print(args.prompt + decode(result.tokens[0]))
    return 0


def _generate_chat(args: argparse.Namespace, cfg, params, sampling, stop_ids: list[int]) -> int:
    from jaxinfra.infer import Generator, chat_replies, resolve_checkpoint, run_chat_template

    template, encoder = run_chat_template(cfg, resolve_checkpoint(args.ckpt)[0])
    gen = Generator(cfg, params, absorb=not args.no_absorb)
    replies, result = chat_replies(gen, template, encoder, [args.prompt], max_new_tokens=args.max_new_tokens,
                                   sampling=sampling, system=args.system, stop_ids=stop_ids)
    print(f"jaxinfra generate: {result.summary()}", file=sys.stderr)
    print(replies[0])
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import numpy as np

    from jaxinfra.infer import load_model, score, token_rows

    if args.tokens is not None:
        tokens = _token_file(args.tokens, args.seq_len)
    cfg, params = load_model(args.ckpt, args.overrides)
    configure_compile_cache(cfg)
    if args.text is not None:
        from jaxinfra.infer import resolve_checkpoint
        from jaxinfra.infer.text import text_ids

        tokens = np.asarray(text_ids(cfg, resolve_checkpoint(args.ckpt)[0], args.text), np.int32)
    seq_len = cfg.train.seq_len if args.seq_len is None else args.seq_len
    tokens, dropped = token_rows(tokens, seq_len)
    if dropped:
        print(f"jaxinfra eval: {args.tokens or args.text}: {tokens.shape[0]} rows of {seq_len + 1} ids "
              f"(seq_len {seq_len} + 1); dropped the last {dropped} ids", file=sys.stderr)
    loss, count = score(cfg, params, tokens, args.batch_size)
    print(json.dumps({"eval_loss": loss, "tokens": count}))
    return 0


def _token_file(path: str, seq_len: int | None):
    """`eval --tokens`: the .npy array (read before any model is loaded: bad input fails fast)."""
    import numpy as np

    from jaxinfra.infer import InferenceError
    from jaxinfra.storage import local_copy

    try:
        tokens = np.load(local_copy(path, "--tokens"), allow_pickle=False)
    except (OSError, ValueError) as e:
        raise InferenceError(f"--tokens: cannot read {path!r} as a .npy array "
                             f"({str(e).splitlines()[0]})") from None
    if seq_len is not None and np.ndim(tokens) != 1:
        raise InferenceError(f"--seq-len applies to 1-D token files; {path!r} has shape {np.shape(tokens)}")
    return tokens
