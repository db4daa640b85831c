"""A tiny PEFT LoRA adapter + reference logits, for tests/test_lora_io.py; and the PEFT check of an export.

Run with the fixture venv (torch + transformers + peft; the test suite itself never imports them):

    python scripts/make_lora_fixtures.py      # writes tests/fixtures/lora/llama/
    python scripts/make_lora_fixtures.py --check-export EXPORT_DIR --reference REF.npz

The adapter sits on the tiny HF Llama of tests/fixtures/hf/llama (made by scripts/make_hf_fixtures.py):
PEFT's `LoraConfig(r=4, lora_alpha=8, target q,k,v,o,gate,up,down)`, with A and B both redrawn non-zero
(PEFT's init leaves B = 0, which would make the adapter a no-op and test nothing). The fixture dir holds
what `PeftModel.save_pretrained` writes (adapter_config.json, adapter_model.safetensors) plus
`reference.npz`: `tokens` [2, 16] int32 (the base fixture's) and `logits` [2, 16, vocab] float32 of the
PEFT model (base + adapters, eager attention, float32).

`--check-export` loads a `jaxinfra hf export RUN OUT --adapters` directory both ways a user would
(`PeftModel.from_pretrained(base, OUT)` on the bare base, and `AutoModelForCausalLM.from_pretrained(OUT)`,
whose PEFT integration attaches the adapter it finds) and compares its logits on REF.npz's tokens with
REF.npz's logits (jaxinfra's, written by the caller): max |diff| / max |ref|, which must be <= 1e-4.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import peft
import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASE = ROOT / "tests" / "fixtures" / "hf" / "llama"
OUT = ROOT / "tests" / "fixtures" / "lora"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 4, 8.0


def base_model(path: pathlib.Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                             dtype=torch.float32).eval()


def logits_of(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.float().numpy()


def randomize_adapters(model: torch.nn.Module, seed: int) -> int:
    """A ~ N(0, 1/in), B ~ N(0, 1/r): each adapter changes its projection's output by O(1) x alpha/r."""
    g = torch.Generator().manual_seed(seed)
    count = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
                count += 1
    return count


def build(seed: int = 7) -> None:
    tokens = np.load(BASE / "reference.npz")["tokens"]
    model = base_model(BASE)
    plain = logits_of(model, tokens)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS,
                             task_type="CAUSAL_LM", bias="none")
    model = peft.get_peft_model(model, config).eval()
    count = randomize_adapters(model, seed)
    logits = logits_of(model, tokens)
    out = OUT / "llama"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*"):
        old.unlink()
    model.save_pretrained(out, safe_serialization=True)
    (out / "README.md").unlink(missing_ok=True)  # PEFT's model card template: nothing a test reads
    _relative_base(out / "adapter_config.json")
    np.savez(out / "reference.npz", tokens=tokens, logits=logits)
    shift = _rel_err(logits, plain)
    print(f"peft {peft.__version__}: {count} adapter tensors -> {out}; the adapters move the logits by "
          f"{shift:.3f} (max |diff| / max |base|)")
    again = peft.PeftModel.from_pretrained(base_model(BASE), out).eval()  # what we wrote loads back
    err = _rel_err(logits_of(again, tokens), logits)
    assert err == 0.0, f"reload changed logits (rel err {err})"


def _relative_base(path: pathlib.Path) -> None:
    """base_model_name_or_path as a path relative to the adapter dir, not this machine's absolute one."""
    import json

    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = os.path.relpath(BASE, path.parent)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def bare_base(export_dir: pathlib.Path, scratch: pathlib.Path) -> torch.nn.Module:
    """The exported base alone: transformers' from_pretrained on a directory with an adapter_config.json
    attaches that adapter itself (its PEFT integration), so the base files are linked into `scratch`."""
    for f in export_dir.iterdir():
        if f.name == "config.json" or f.name.startswith("model"):
            (scratch / f.name).symlink_to(f.absolute())
    return base_model(scratch)


def check_export(export_dir: pathlib.Path, reference: pathlib.Path) -> int:
    """Both ways a user loads the pair: PeftModel.from_pretrained(base, OUT) and transformers' own
    from_pretrained(OUT), which finds adapter_config.json and attaches the adapter."""
    import tempfile

    ref = np.load(reference)
    with tempfile.TemporaryDirectory() as scratch:
        model = peft.PeftModel.from_pretrained(bare_base(export_dir, pathlib.Path(scratch)), export_dir).eval()
        err = _rel_err(logits_of(model, ref["tokens"]), ref["logits"])
    loaded = sum(1 for n, _ in model.named_parameters() if ".lora_" in n)
    auto = base_model(export_dir)
    auto_err = _rel_err(logits_of(auto, ref["tokens"]), ref["logits"])
    auto_loaded = sum(1 for n, _ in auto.named_parameters() if ".lora_" in n)
    ok = max(err, auto_err) <= 1e-4 and loaded > 0 and auto_loaded == loaded
    print(f"check-export {export_dir}: max |diff| / max |ref| of the logits: PeftModel.from_pretrained "
          f"({loaded} adapter tensors) {err:.2e}, AutoModelForCausalLM.from_pretrained ({auto_loaded} adapter "
          f"tensors) {auto_err:.2e}: {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check-export", type=pathlib.Path, metavar="EXPORT_DIR")
    parser.add_argument("--reference", type=pathlib.Path, metavar="REF.npz")
    args = parser.parse_args()
    if args.check_export:
        if args.reference is None:
            parser.error("--check-export needs --reference REF.npz (tokens, logits)")
        return check_export(args.check_export, args.reference)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    build()
    return 0


if __name__ == "__main__":
    sys.exit(main())
