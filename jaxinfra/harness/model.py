"""`JaxinfraLM`: lm-evaluation-harness's model `jaxinfra` (imports lm_eval: load it through
jaxinfra.harness.require_lm_eval first).

Follows lm-eval's HF model (lm_eval/models/huggingface.py) request for request, so the two agree
on the same weights: contexts and continuations are tokenized by lm-eval's TemplateLM (trailing
spaces move to the continuation; an empty context is the prefix id), a (context + continuation)
longer than max_length + 1 ids keeps its last max_length + 1 (left truncation), the continuation's
log-prob is the sum of its tokens' log-softmax, `is_greedy` whether each is the argmax;
`loglikelihood_rolling` sums lm-eval's disjoint rolling windows; `generate_until` decodes greedily
(or samples when asked) with the context left-truncated to max_length - max_gen_toks and cuts
the text at the first stop string (the end-of-text's text included).
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import Mesh
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from jaxinfra.config import Config
from jaxinfra.harness.forward import TokenScorer, bucket, no_ambient_mesh
from jaxinfra.harness.generate import generate_texts
from jaxinfra.harness.tokens import RunTokenizer, run_tokenizer


@register_model("jaxinfra")
class JaxinfraLM(TemplateLM):
    """A jaxinfra run (or live training params) as an lm-eval model, batched on the run's mesh."""

    def __init__(self, pretrained: str | None = None, overrides: str | Sequence[str] = (), batch_size: int | str = 8,
                 max_length: int | None = None, max_gen_toks: int = 256, **_unused: Any):
        """lm-eval's `--model jaxinfra --model_args pretrained=RUN,overrides=mesh.tensor=2 mesh.fsdp=4`:
        a run dir or RUN/checkpoints/<step>, KEY=VALUE overrides (space-separated in one string)."""
        super().__init__()
        if pretrained is None:
            raise ValueError("JaxinfraLM needs pretrained=RUN (or JaxinfraLM.from_memory)")
        from jaxinfra.infer.loading import load_model, resolve_checkpoint

        overrides = overrides.split() if isinstance(overrides, str) else list(overrides)
        cfg, params = load_model(pretrained, overrides)
        rows = int(batch_size) if str(batch_size).isdigit() else 8  # lm-eval's "auto": our default
        self._setup(cfg, params, resolve_checkpoint(pretrained)[0], None, rows, max_length, max_gen_toks)

    @classmethod
    def from_memory(cls, cfg: Config, params: nnx.State, *, run_dir: str | pathlib.Path | None = None,
                    mesh: Mesh | None = None, batch_size: int = 8, max_length: int | None = None,
                    max_gen_toks: int = 256) -> JaxinfraLM:
        """An LM over params already in memory (a training run's, on its `mesh`: used in place)."""
        self = cls.__new__(cls)
        TemplateLM.__init__(self)
        self._setup(cfg, params, run_dir, mesh, batch_size, max_length, max_gen_toks)
        return self

    def _setup(self, cfg: Config, params: nnx.State, run_dir: Any, mesh: Mesh | None, batch_size: int,
               max_length: int | None, max_gen_toks: int) -> None:
        self.cfg = cfg
        self.tok: RunTokenizer = run_tokenizer(cfg, run_dir)
        self.scorer = TokenScorer(cfg, params, batch_size=batch_size, mesh=mesh)
        self._max_length = int(max_length or cfg.train.seq_len)  # what the model was trained to attend over
        self._max_gen_toks = max_gen_toks
        self._generator = None  # built on the first generate_until

    def update_params(self, params: nnx.State) -> None:
        """Newer params of the same model (same shapes and shardings): the compiled programs are kept."""
        self.scorer.update_params(params)

    # ---- what TemplateLM asks
    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.prefix_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tok.name.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tok.template_source() if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tok.chat_text(chat_history, add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tok.encode(string)

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))

    # ---- scoring
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False, **_: Any) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probs, all greedy) per (key, context ids, continuation ids)."""
        rows = []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]  # left-truncated as HF does
            rows.append((whole[:-1], whole[1:], min(len(continuation), len(whole) - 1)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # longest first, as lm-eval's Collator
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        size = self.scorer.batch
        for lo in range(0, len(order), size):
            chunk = order[lo:lo + size]
            width = bucket(len(rows[chunk[0]][0]), self.max_length)
            scores = self.scorer.score([rows[i][:2] for i in chunk], width)
            for i, (logps, greedy) in zip(chunk, scores):
                n = len(logps) - rows[i][2]  # the continuation is the last targets
                out[i] = (float(np.sum(logps[n:], dtype=np.float64)), bool(np.all(greedy[n:])))
        for (key, _, _), answer in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Per string, the sum of its tokens' log-probs over lm-eval's disjoint rolling windows of max_length."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for n, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(n)
        sums = np.zeros(len(requests), np.float64)
        for n, (logp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            sums[n] += logp
        for req, total in zip(requests, sums):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, float(total))
        return [float(s) for s in sums]

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        if self._generator is None:
            from jaxinfra.infer.generation import Generator

            with no_ambient_mesh():
                self._generator = Generator(self.cfg, self.scorer.params, mesh=self.scorer.mesh)
        out = generate_texts(self, [req.args for req in requests])
        for req, text in zip(requests, out):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out

    @property
    def generator(self) -> Any:
        return self._generator

