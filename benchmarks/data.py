"""Data throughput on CPU: `data prepare` against the tokenizer's raw speed, and the loader against
the `small` preset's training step, all in one run.

    python benchmarks/data.py [--mb 24] [--vocab 8192] [--workers 1,2] [--batches 200] [--steps 5]

1. A corpus: the Python standard library's .py files as JSON Lines (one document per file), up
   to --mb MB, and a byte-level BPE tokenizer.json trained on it (vocab --vocab, with
   <|endoftext|>), written to a temporary directory.
2. For each --workers count N: the tokenizer's raw speed, `encode_batch_fast` over the same
   texts in ~1 MiB batches, one thread per process (TOKENIZERS_PARALLELISM=false, as each
   prepare worker runs), in N processes at once (per process: the contention N prepare workers
   meet); then `data prepare --workers N`: tokens/s in all and per worker, and raw / per-worker
   (the target: <= 2).
3. The loader: data.source=tokens on the prepared directory, the `small` preset's batch
   (8 x 256), data.worker_count as the preset (0): tokens/s delivered (rows x seq_len / s, and
   the non-padding share), packed with segment ids; and the same for data.source=jsonl on the
   corpus itself (tokenized on the fly).
4. The `small` preset's training step on random batches (benchmarks/step_cpu.py), tokens/s,
   and loader / step (the target: >= 20).

The load average is printed before and after: other processes on the machine skew everything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one tokenizer thread, as in each prepare worker


def write_corpus(root: str, megabytes: float) -> tuple[str, list[str]]:
    """(path of a .jsonl of the stdlib's .py files, their texts)."""
    from jaxinfra.data.sources import stdlib_files

    _, files = stdlib_files()
    texts, size = [], 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        texts.append(text)
        size += len(text.encode())
        if size >= megabytes * 1e6:
            break
    path = os.path.join(root, "stdlib.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return path, texts


def train_tokenizer(root: str, texts: list[str], vocab: int) -> str:
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    sample = texts[: max(1, len(texts) // 3)]
    tok.train_from_iterator(sample, tokenizers.trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    path = os.path.join(root, "tokenizer.json")
    tok.save(path)
    return path


def _batches(texts: list[str]) -> list[list[str]]:
    """Texts in ~1 MiB batches, as `data prepare` hands them to the tokenizer."""
    batches, batch, size = [], [], 0
    for t in texts:
        batch.append(t)
        size += len(t)
        if size >= 1 << 20:
            batches.append(batch)
            batch, size = [], 0
    return [*batches, batch] if batch else batches


def _encode_timed(job: tuple[str, list[list[str]]]) -> tuple[int, float]:
    """(tokens, seconds) of encode_batch_fast over the batches, in this process."""
    import tokenizers

    path, batches = job
    tok = tokenizers.Tokenizer.from_file(path)
    t0 = time.perf_counter()
    tokens = sum(len(e.ids) for b in batches for e in tok.encode_batch_fast(b, add_special_tokens=False))
    return tokens, time.perf_counter() - t0


def raw_tokens_per_s(tokenizer: str, texts: list[str], workers: int) -> float:
    """The tokenizer's own batched speed per process, with `workers` processes encoding at once (each
    its share of the batches, one thread each): the same contention a prepare with that many workers
    meets on this machine."""
    batches = _batches(texts)
    if workers == 1:
        tokens, seconds = _encode_timed((tokenizer, batches))
        return tokens / seconds
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    with ctx.Pool(workers) as pool:
        results = pool.map(_encode_timed, [(tokenizer, batches[w::workers]) for w in range(workers)])
    return sum(tokens / seconds for tokens, seconds in results) / workers


def prepare_tokens_per_s(corpus: str, tokenizer: str, out: str, workers: int) -> tuple[float, int]:
    from jaxinfra.data.prepare import prepare

    t0 = time.perf_counter()
    meta = prepare([corpus], out, tokenizer=tokenizer, workers=workers, progress=False)
    return meta["tokens"] / (time.perf_counter() - t0), meta["tokens"]


def loader_tokens_per_s(cfg, batches: int) -> tuple[float, float]:
    """(rows x seq_len per second, share of non-padding positions) of the train iterator."""
    from jaxinfra.data import make_train_iterator

    t = cfg.train
    it = make_train_iterator(cfg.data, seq_len=t.seq_len, global_batch_size=t.batch_size,
                             vocab_size=cfg.model.vocab_size, seed=t.seed)
    next(it)  # start-up (index, first reads) is not steady state
    filled = 0
    t0 = time.perf_counter()
    for _ in range(batches):
        batch = next(it)
        filled += int((batch["segment_ids"] > 0).sum())
    seconds = time.perf_counter() - t0
    return batches * t.batch_size * t.seq_len / seconds, filled / (batches * t.batch_size * t.seq_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=24.0, help="corpus size")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--workers", default="1,2", help="prepare worker counts to time")
    ap.add_argument("--batches", type=int, default=200, help="loader batches to time")
    ap.add_argument("--steps", type=int, default=5, help="small-preset training steps to time")
    args = ap.parse_args()
    load_before = os.getloadavg()
    root = tempfile.mkdtemp(prefix="jaxinfra-data-bench-")
    corpus, texts = write_corpus(root, args.mb)
    tokenizer = train_tokenizer(root, texts, args.vocab)
    print(f"corpus {os.path.getsize(corpus) / 1e6:.1f} MB ({len(texts)} documents), tokenizer vocab {args.vocab}; "
          f"load average {load_before[0]:.2f}")
    for workers in (int(w) for w in args.workers.split(",")):
        raw = raw_tokens_per_s(tokenizer, texts, workers)
        tps, tokens = prepare_tokens_per_s(corpus, tokenizer, os.path.join(root, f"prepared-{workers}"), workers)
        print(f"{workers} worker(s): raw encode_batch_fast {raw:,.0f} tokens/s per process; data prepare "
              f"{tps:,.0f} tokens/s = {tps / workers:,.0f} per worker ({tokens:,} tokens); raw / per-worker = "
              f"{raw / (tps / workers):.2f}")

    from jaxinfra.config import load_config

    prepared = os.path.join(root, "prepared-" + args.workers.split(",")[0])
    cfg = load_config("small", ["data.source=tokens", f"data.paths=[{prepared}]", f"data.tokenizer={tokenizer}",
                                "mesh.data=1"])
    loader, fill = loader_tokens_per_s(cfg, args.batches)
    print(f"loader (data.source=tokens, {cfg.train.batch_size} x {cfg.train.seq_len}, data.worker_count="
          f"{cfg.data.worker_count}): {loader:,.0f} tokens/s ({fill:.1%} non-padding)")
    fly_cfg = load_config("small", ["data.source=jsonl", f"data.paths=[{corpus}]", f"data.tokenizer={tokenizer}",
                                    "mesh.data=1"])
    fly, fly_fill = loader_tokens_per_s(fly_cfg, args.batches)
    print(f"loader (data.source=jsonl, tokenized on the fly, same batch and workers): {fly:,.0f} tokens/s "
          f"({fly_fill:.1%} non-padding)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from step_cpu import time_steps

    _, step_s = time_steps(cfg, args.steps)
    step = cfg.train.batch_size * cfg.train.seq_len / step_s
    print(f"small preset training step: {step:,.0f} tokens/s; loader / step = {loader / step:.1f} "
          f"(on the fly: {fly / step:.1f})")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
