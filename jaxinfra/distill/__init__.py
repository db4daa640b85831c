"""Knowledge distillation: a student trained on a teacher's logits, online or from saved top-k logits.

    config.py   the `distill` config section (off by default) and its checks
    loss.py     the soft loss T^2 * KL(softmax(t/T) || softmax(s/T)) (full vocabulary or the teacher's
                top-k), its mix with cross-entropy, the alpha / temperature schedules
    teacher.py  the teacher: a run dir, checkpoint step dir or `hf import` output; its own config
                gives its architecture; params restored onto the student's mesh, by the same rules
    step.py     one loss chunk's distillation sums (online: from the teacher's logits; offline: from
                the saved top-k logits of the batch)
    logits.py   the offline logits directory: writer, reader, its meta and the checks against a run
    save.py     `jaxinfra distill save-logits`: the teacher's top-k logits of the batches of steps 1..N
    extension.py  `Distillation`, the train step's extension (jaxinfra/extensions.py): teacher params
                as a frozen step input, saved logits as batch fields, loss terms, metrics, eval field,
                checkpoint meta; registered as the `jaxinfra.extensions` entry point `distill` (pyproject.toml)
    cli.py      the `jaxinfra distill` subcommands

docs/distillation.md is the user page. Nothing here is imported unless `distill` is on, except
config.py (the config tree embeds it; it imports no jax).
"""
