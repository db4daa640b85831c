"""jaxinfra: a JAX/Flax-NNX LLM training stack.

Layers, lowest first; a module imports only its own layer or lower ones, and the import graph
has no cycles (tests/test_layout.py checks both, function-level imports included):

    kernels/ -> sharding/ -> models/ -> jaxinfra core -> jaxinfra features -> the command line

Modules of `jaxinfra/` (see docs/architecture.md for how one run goes through them):

  core: the training run, and what every feature builds on
    config.py      preset YAML + dotted overrides -> one frozen, typed, validated Config (no jax)
    config_sections.py  the feature packages' sections of that config (`distill`), without jax
    presets/       the named configs (tiny, small, llama3-8b, mixtral-tiny, deepseek-v3, ...)
    exits.py       every exit status, and which exceptions are bad input
    flags.py       number_flag: every numeric command-line flag with its range (one line, exit 2)
    distributed.py jax.distributed start-up from flags, environment or a detected cluster;
                   exchange_json (small per-process dicts shared by every process)
    rundir.py      run-directory checks and the one-live-run lock
    watchdog.py    ends a process whose step or collective hangs (exit 70)
    data/          grain input pipeline (text, token files, prepared dirs, jsonl/parquet, synthetic,
                   mixtures) packed into batches; `data prepare` / `data inspect`'s machinery
    metrics/       FLOP counts, device peaks, MFU, JSONL/TensorBoard writers, table formatting; step
                   profiles (HLO classes, trace shares) and a run's profile window (log.profile_steps)
    optim.py       learning-rate schedules and AdamW with its decay mask and clipping
    loss.py        token-sum cross-entropy with z-loss; MoE router losses and metrics
    state.py       TrainState (params, opt state, model stats, extension state) created in its sharded
                   layout, abstract (shape-only) trees
    step.py        the jitted train step (gradient accumulation, NaN guard) and eval step
    extensions.py  the train step's extension seam: loss terms, batch fields, frozen inputs, own state,
                   post-update, trainable subset; ModelStats (router bias, amax histories)
    quant_checks.py  the quant section's checks that need the devices (fp8 support; int8 storage only
                   as a LoRA run's frozen base)
    runtime.py     build_runtime: mesh, sharding rules, optimizer and jitted steps, built once
    checkpoint.py  Orbax checkpoints of state + data position + config; restore, export-params
    compile_cache.py  XLA's persistent compilation cache (train.compile_cache), bad entries replaced
    train.py       the training loop: resume, logging, evaluation, checkpoints, signals

  features: tools over the core; each may import the core and other features, never the CLI
    infer/         inference: checkpoint loading, generation with a KV cache, eval of token files
    harness/       lm-evaluation-harness: the `jaxinfra` model, `eval --tasks`, the in-training `eval` extension
    quantize.py    `jaxinfra quantize`: weight-only int8 checkpoints
    distill/       knowledge distillation: online teacher or saved top-k logits, `distill save-logits`
    lora/          LoRA / QLoRA: the adapters as the trained subset over a frozen base, `lora merge`
    reference.py   the frozen reference policy of DPO / GRPO (a run, the run's start, LoRA's base)
    dpo/           DPO on preference pairs: loss, the `dpo` extension, `dpo save-reference`
    grpo/          GRPO with verifiable rewards: prompts, rewards, rollouts with the params in place, `grpo`
    hf/            Hugging Face interop: import safetensors checkpoints as runs, export runs back
    plan/          `jaxinfra plan`: analytic memory per device, step time, bottleneck, layout search
    scaling/       scaling-law sweeps: spec -> runs -> results table -> Chinchilla fits -> plots
    info.py        `jaxinfra info`: devices, versions, mesh, per-parameter sharding and memory
    bench.py       `jaxinfra bench collectives`: collective timings per mesh axis
    launch.py      `jaxinfra launch`: N local processes that act as N hosts (multi-host tests)

  the command line (top):
    cli.py         every command, its flags, bad input -> one line and exit 2
    data_cli.py    the `data prepare|inspect` subcommands (they read a run config, so not in data/)
    __main__.py    `python -m jaxinfra`, the same as the `jaxinfra` command

Sibling top-level packages (importable without jaxinfra; each imports only the ones after it):

    models/        the Flax NNX Transformer (dense, MoE, MLA), parameters named by logical axes
    sharding/      meshes, logical-axis -> mesh-axis rules, context, expert and pipeline parallelism
    kernels/       attention kernels (Pallas flash for GPU/TPU, cuDNN, XLA reference) behind one entry

Each package's `config.py` (models/, sharding/, kernels/, jaxinfra/data/) holds its config types
and allowed names without jax, and package `__init__`s load their jax-heavy names on first use
(PEP 562), so `import jaxinfra.config` and `load_config` never load jax. Every numeric field of those
types declares its range beside it (`sharding/ranges.py` ranged(): the lowest layer with a section).
"""
