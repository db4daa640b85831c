"""SFT as a step extension (jaxinfra/extensions.py): the loss trains only the chosen targets.

Chat batches (data.source=chat, jaxinfra/data/) carry `assistant`, the role code of each target
token (0: not trained, 1: an assistant turn, 2: the conversation's last assistant turn; 0 on
padding), and `truncated` (1 at the first position of a conversation cut to fit train.seq_len).

- loss mask (train and eval): sft.train_on=assistant -> code > 0, last_assistant -> code == 2,
  all -> no limit (every real token). The core ANDs it with `segment_ids > 0` before the loss
  chunks, so the loss, `tokens` and the gradient's normalisation count only trained tokens: the
  loss is the mean over the trained tokens of the global batch (exact under gradient
  accumulation: the step sums, then divides once);
- metrics `trained_tokens` (the global count of trained targets of the step) and
  `truncated_conversations` (conversations of the step cut to fit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfra.config import Config
from jaxinfra.config_sections import chat_data
from jaxinfra.extensions import StepContext, StepExtension

TRUNCATED_SUM = "truncated_sum"


def for_config(cfg: Config) -> StepExtension | None:
    """The `jaxinfra.extensions` entry point (pyproject.toml): SFT exactly when the data is chat (a
    mixture is all chat or all documents: jaxinfra/data/config.py refuses a mix)."""
    return Sft(cfg.sft.train_on) if chat_data(cfg) else None


class Sft(StepExtension):
    name = "sft"
    metric_names = ("trained_tokens", "truncated_conversations")

    def __init__(self, train_on: str = "assistant"):
        if train_on not in ("assistant", "all", "last_assistant"):
            raise ValueError(f"sft.train_on={train_on!r}: choose assistant, all or last_assistant")
        self.train_on = train_on

    def batch_specs(self, shape: tuple[int, int]) -> dict[str, jax.ShapeDtypeStruct]:
        """The chat batch's own fields (the data pipeline adds them), for the plan's --compile."""
        return {k: jax.ShapeDtypeStruct(shape, np.int32) for k in ("assistant", "truncated")}

    def loss_mask(self, ctx: StepContext) -> jax.Array | None:
        if self.train_on == "all":
            return None
        codes = ctx.batch["assistant"]
        return codes == 2 if self.train_on == "last_assistant" else codes > 0

    def objective(self, ctx: StepContext, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        # A sum like the token sums, so microbatches add up to the step's count.
        return {**sums, TRUNCATED_SUM: jnp.sum(ctx.batch["truncated"]).astype(jnp.float32)}

    def metrics(self, sums: dict[str, jax.Array], tokens: jax.Array) -> dict[str, jax.Array]:
        return {"trained_tokens": sums["tokens"], "truncated_conversations": sums[TRUNCATED_SUM]}
