"""Peak host RSS of `jaxinfra hf import` on a ~500M-parameter random Llama-shaped checkpoint.

    PYTHONPATH=. python benchmarks/hf_import.py [--dir /tmp/hf_helper/bench] [--keep]

Writes a float32 safetensors checkpoint (numpy + safetensors only, one tensor in memory at a
time) with a Llama config.json, then runs the import in a subprocess (so the writer's memory
does not count) and reports that process's peak RSS against the bytes on disk and against a
baseline process that only starts JAX and the CLI. Deletes the files afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(vocab_size=32000, hidden_size=1536, num_hidden_layers=16, num_attention_heads=12,
             num_key_value_heads=4, intermediate_size=4096)


def llama_tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * d // c["num_attention_heads"]
    out = [("model.embed_tokens.weight", (v, d))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", (d,)), (f"{p}.post_attention_layernorm.weight", (d,)),
                (f"{p}.self_attn.q_proj.weight", (d, d)), (f"{p}.self_attn.k_proj.weight", (kv, d)),
                (f"{p}.self_attn.v_proj.weight", (kv, d)), (f"{p}.self_attn.o_proj.weight", (d, d)),
                (f"{p}.mlp.gate_proj.weight", (f, d)), (f"{p}.mlp.up_proj.weight", (f, d)),
                (f"{p}.mlp.down_proj.weight", (d, f))]
    return out + [("model.norm.weight", (d,)), ("lm_head.weight", (v, d))]


def write_checkpoint(directory: pathlib.Path, shards: int = 4) -> int:
    from jaxinfra.hf.safetensors_io import plan_shards, write_safetensors

    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, **SHAPE}
    (directory / "config.json").write_text(json.dumps(config))
    specs = [(n, s, np.dtype(np.float32)) for n, s in llama_tensors(config)]
    total = sum(int(np.prod(s)) * 4 for _, s, _ in specs)
    rng = np.random.default_rng(0)
    weight_map = {}
    groups = plan_shards(specs, total // shards + 1)
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"

        def data(group=group):
            for n, s, _ in group:
                yield n, (rng.standard_normal(s, dtype=np.float32) * 0.02)

        write_safetensors(directory / name, group, data())
        weight_map.update({n: name for n, _, _ in group})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                       "weight_map": weight_map}))
    return sum(int(np.prod(s)) for _, s, _ in specs)


def run(cmd: list[str]) -> tuple[str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return proc.stdout, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=pathlib.Path, default=pathlib.Path("/tmp/hf_helper/bench"))
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    hf_dir, out = args.dir / "hf", args.dir / "imported"
    shutil.rmtree(args.dir, ignore_errors=True)
    params = write_checkpoint(hf_dir)
    disk = sum(p.stat().st_size for p in hf_dir.glob("*.safetensors"))
    baseline, _ = run([sys.executable, "-c", "import resource, jax, jax.numpy as jnp, jaxinfra.cli; "
                       "jnp.zeros(1).block_until_ready(); "
                       "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"])
    stdout, wall = run([sys.executable, "-m", "jaxinfra", "hf", "import", str(hf_dir), str(out), "mesh.data=1"])
    m = re.search(r"peak host RSS (\d+) MiB", stdout)
    peak = int(m.group(1)) * 2**20
    base = int(baseline.strip().splitlines()[-1])
    print(stdout.strip())
    print(f"params {params / 1e6:.0f}M, float32 on disk {disk / 2**30:.2f} GiB; import {wall:.0f}s wall; "
          f"peak RSS {peak / 2**30:.2f} GiB = {peak / disk:.2f} x disk; baseline (jax + CLI) {base / 2**30:.2f} GiB; "
          f"peak - baseline {(peak - base) / 2**30:.2f} GiB = {(peak - base) / disk:.2f} x disk")
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
