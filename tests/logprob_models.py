"""The tiny test models of the sampler-vs-trainer log-prob check (tests/test_logprobs.py,
scripts/logprob_gap.py): one per family, float32 or bfloat16, random weights with a sharp
enough distribution that greedy and sampled completions differ."""

from __future__ import annotations

import jax

from jaxinfra.config import load_config
from jaxinfra.infer import Sampling
from jaxinfra.state import init_params

BASE = ["data.source=synthetic", "model.vocab_size=64", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
        "model.mlp_dim=64", "model.tie_embeddings=false", "model.init_std=0.3", "mesh.data=1"]
MLA = [*BASE, "model.num_kv_heads=null", "model.attention_type=mla", "model.q_lora_rank=16", "model.kv_lora_rank=16",
       "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=8"]
FAMILIES = {
    "dense MHA": [*BASE, "model.num_kv_heads=4"],
    "GQA": [*BASE, "model.num_kv_heads=2", "model.head_dim=8"],
    "MLA": MLA,
    # deepseek-tiny's routing: capacity dispatch at factor 1.5 in training (the sampler is dropless)
    "MoE": [*MLA, "model.num_layers=3", "model.moe_num_experts=4", "model.moe_top_k=2", "model.moe_mlp_dim=16",
            "model.moe_shared_experts=1", "model.moe_first_dense_layers=1", "model.moe_router_score=sigmoid",
            "model.moe_num_groups=2", "model.moe_top_k_groups=1", "model.moe_dispatch=capacity",
            "model.moe_capacity_factor=1.5", "model.moe_bias_update_rate=0.01"],
}
PROMPTS = [[5, 9, 1, 33, 2], [7, 3, 60, 12, 40, 41, 8, 19, 22, 50, 11], [1], [30, 31, 32, 33, 34, 35, 36]]
SAMPLINGS = {"greedy": Sampling(), "T=1": Sampling(temperature=1.0, seed=3), "T=0.7": Sampling(temperature=0.7, seed=4)}


def make(family: str, dtype: str = "float32", seed: int = 0, skewed_router: bool = False, extra: tuple = ()):
    """(Config, params) of a family's tiny model in `dtype` (params and compute). The router bias
    starts at zero as in training (balanced enough that capacity 1.5 drops nothing here);
    `skewed_router` draws it at random, so that training's capacity dispatch drops tokens."""
    cfg = load_config("tiny", [*FAMILIES[family], f"model.dtype={dtype}", f"model.param_dtype={dtype}", *extra])
    params = init_params(cfg.model, jax.random.key(seed))
    if not skewed_router:
        return cfg, params

    def fill_bias(path, x):  # a nonzero router bias, so that expert selection depends on it
        if "bias" in jax.tree_util.keystr(path):
            return jax.random.normal(jax.random.key(seed + 1), x.shape, x.dtype)
        return x

    return cfg, jax.tree_util.tree_map_with_path(fill_bias, params)
