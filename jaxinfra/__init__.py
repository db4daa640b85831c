"""jaxinfra: a JAX/Flax-NNX LLM training stack.

Modules of `jaxinfra/` (see docs/architecture.md for how one run goes through them):

    __main__.py    `python -m jaxinfra`, the same as the `jaxinfra` command
    cli.py         the command line: every command, its flags, bad input -> one line and exit 2
    exits.py       every exit status, and which exceptions are bad input
    config.py      preset YAML + dotted overrides -> one frozen, typed, validated Config
    presets/       the named configs (tiny, small, llama3-8b, mixtral-tiny, deepseek-v3, ...)
    runtime.py     build_runtime: mesh, sharding rules, optimizer and jitted steps, built once
    state.py       TrainState (params, opt state, model stats, extension state) created in its sharded
                   layout, abstract (shape-only) trees
    step.py        the jitted train step (gradient accumulation, NaN guard) and eval step
    extensions.py  the train step's extension seam: loss terms, batch fields, frozen inputs, own state,
                   post-update, trainable subset; ModelStats (router bias, amax histories)
    features.py    extensions_for(cfg): the feature extensions a config asks for (distillation)
    loss.py        token-sum cross-entropy with z-loss; MoE router losses and metrics
    optim.py       learning-rate schedules and AdamW with its decay mask and clipping
    train.py       the training loop: resume, logging, evaluation, checkpoints, signals
    checkpoint.py  Orbax checkpoints of state + data position + config; restore, export-params
    watchdog.py    ends a process whose step or collective hangs (exit 70)
    distributed.py jax.distributed start-up from flags, environment or a detected cluster
    launch.py      `jaxinfra launch`: N local processes that act as N hosts (multi-host tests)
    info.py        `jaxinfra info`: devices, versions, mesh, per-parameter sharding and memory
    quantize.py    `jaxinfra quantize`: weight-only int8 checkpoints; the quant checks that need devices
    bench.py       `jaxinfra bench collectives`: collective timings per mesh axis
    plan/          `jaxinfra plan`: analytic memory per device, step time, bottleneck, layout search
    data/          grain input pipeline (text, token files, prepared dirs, jsonl/parquet, synthetic,
                   mixtures) packed into batches; `data prepare` / `data inspect`
    metrics/       FLOP counts, device peaks, MFU, JSONL/TensorBoard writers, table formatting
    scaling/       scaling-law sweeps: spec -> runs -> results table -> Chinchilla fits -> plots
    hf/            Hugging Face interop: import safetensors checkpoints as runs, export runs back
    infer/         inference: checkpoint loading, generation with a KV cache, eval of token files
    distill/       knowledge distillation: online teacher or saved top-k logits, `distill save-logits`

Sibling top-level packages (importable without jaxinfra; each imports only the ones after it):

    models/        the Flax NNX Transformer (dense, MoE, MLA), parameters named by logical axes
    sharding/      meshes, logical-axis -> mesh-axis rules, context, expert and pipeline parallelism
    kernels/       attention kernels (Pallas flash for GPU/TPU, XLA reference) behind one entry
"""
