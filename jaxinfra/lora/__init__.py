"""LoRA and QLoRA: low-rank adapters trained over a frozen (float or int8) base.

    extension.py  `Lora`, the train step's extension (jaxinfra/extensions.py): the optimizer trains only
                  the adapters (LoraA, LoraB); registered as the `jaxinfra.extensions` entry point `lora`
    merge.py      `merge_lora(run, out)`: W + A B * alpha/rank folded into each target, written as a
                  params-only run dir with lora.rank=0 (`jaxinfra lora merge RUN OUT`)
    cli.py        the `jaxinfra lora` subcommands

The config section (`lora`) and the adapters themselves live in models/ (models/lora_config.py,
models/project.py): models get the section at construction, like `quant`. docs/post-training.md is the user page.
"""
