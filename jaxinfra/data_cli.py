"""The `data` subcommands (registered by jaxinfra/cli.py's build_parser).

In the command-line layer beside cli.py, not in data/: `data inspect` reads a run config, and
jaxinfra/config.py imports data/ (its section types, its vocabulary), so data/ cannot import it back.

    jaxinfra data prepare INPUT... --out DIR (--tokenizer PATH | --bytes) [--text-key text] [--workers N]
                          [--shard-tokens N] [--eod-token TOKEN] [--chat [--chat-template SPEC]]
    jaxinfra data inspect DIR [CONFIG] [KEY=VALUE ...] [--sample N] [--verify]

Bad data raises DataError, which jaxinfra.cli.main turns into one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import time

from jaxinfra.flags import number_flag


def cmd_prepare(args: argparse.Namespace) -> int:
    from jaxinfra.config import ConfigError
    from jaxinfra.data.prepare import prepare

    if getattr(args, "overrides", None):
        raise ConfigError(f"data prepare takes no KEY=VALUE overrides: {' '.join(args.overrides)}")
    start = time.perf_counter()
    sizes = {"shard_tokens": args.shard_tokens} if args.shard_tokens is not None else {}
    if args.chat_template is not None and not args.chat:
        raise ConfigError("data prepare: --chat-template needs --chat")
    chat = (args.chat_template or "chatml") if args.chat else None
    meta = prepare(args.inputs, args.out, tokenizer=args.tokenizer, text_key=args.text_key, workers=args.workers,
                   eod_token=args.eod_token, progress=not args.no_progress, chat_template=chat, **sizes)
    seconds = time.perf_counter() - start
    if chat:
        print(f"prepared {meta['documents']:,} conversations, {meta['tokens']:,} tokens ({meta['dtype']} ids + "
              f"uint8 role codes, vocabulary {meta['vocab_size']}, chat template {meta['chat']['origin']}) in "
              f"{len(meta['shards'])} shard(s) -> {args.out} ({seconds:.1f}s)")
        return 0
    print(f"prepared {meta['documents']:,} documents, {meta['tokens']:,} tokens ({meta['dtype']}, vocabulary "
          f"{meta['vocab_size']}, end of document = id {meta['eod_id']}) in {len(meta['shards'])} shard(s) -> "
          f"{args.out} ({seconds:.1f}s)")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from jaxinfra.config import Config, apply_overrides, fit_vocab, from_dict, load_yaml, vocab_left_unset
    from jaxinfra.data.inspect import inspect, raise_failures
    from jaxinfra.data.prepared import load_meta

    cfg = None
    if args.config or args.overrides:  # types are checked, cross-checks are this command's report
        tree = apply_overrides(load_yaml(args.config) if args.config else {}, args.overrides)
        cfg = from_dict(Config, tree, "")
        if vocab_left_unset(tree):  # the vocabulary a run reading this directory would get
            cfg = fit_vocab(cfg, int(load_meta(args.directory)["vocab_size"]))
    report, failures = inspect(args.directory, cfg, sample=args.sample, verify=args.verify)
    print(report)
    raise_failures(failures, args.directory)
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Adds `data {prepare,inspect}` to the jaxinfra parser."""
    data = sub.add_parser("data", help="prepare a corpus into token shards once; inspect a prepared directory")
    data_sub = data.add_subparsers(dest="data_command", required=True)

    p = data_sub.add_parser("prepare", help="tokenize .jsonl(.gz) / Parquet / text files into token shards")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories or globs")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (a rerun resumes it)")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--tokenizer", metavar="PATH", help="a Hugging Face tokenizer.json")
    how.add_argument("--bytes", action="store_true", help="byte-level ids 0..255, end of document = 256")
    p.add_argument("--text-key", default="text", help="JSON field / Parquet column of the text (default: text)")
    number_flag(p, "--workers", lo=1, sep=" ", default=None, help="tokenizer processes (default: one per CPU)")
    number_flag(p, "--shard-tokens", lo=1, sep=" ", metavar="N",
                   help="close a shard after the document that reaches N tokens (default 50M)")
    p.add_argument("--eod-token", metavar="TOKEN", help="the tokenizer's end-of-document token (default: the "
                   "first of <|endoftext|>, <|end_of_text|>, </s>, <eos>, ... it has; else a new id)")
    p.add_argument("--chat", action="store_true", help="inputs are chat rows (messages, or prompt/response): "
                   "each becomes one rendered conversation, with uint8 role-code shards (data.source=chat)")
    p.add_argument("--chat-template", metavar="SPEC", help="with --chat: chatml (default), tokenizer (the "
                   "tokenizer_config.json beside --tokenizer) or a Jinja file; train with the same data.chat_template")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_prepare)

    p = data_sub.add_parser("inspect", help="counts, length histogram, a decoded sample, checks against a config")
    p.add_argument("directory", metavar="DIR")
    p.add_argument("config", nargs="?", help="preset or YAML whose model.vocab_size / data.tokenizer to check")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    number_flag(p, "--sample", lo=0, default=0, metavar="N", help="which document to decode (default 0)")
    p.add_argument("--verify", action="store_true", help="also hash every shard against meta.json")
    p.set_defaults(func=cmd_inspect)
