"""Supervised fine-tuning on chat data (data.source=chat): only the trained tokens count.

    config.py     the `sft` config section (`train_on`), re-exported from jaxinfra/config_sections.py
    extension.py  `Sft`, the train step's extension (jaxinfra/extensions.py): the loss mask from the
                  batch's role codes (train and eval), metrics `trained_tokens` and
                  `truncated_conversations`; the `jaxinfra.extensions` entry point `sft` (pyproject.toml)
    tasks.py      a synthetic chat task (two-digit addition), its held-out exact-match rate through
                  `generate --chat`; for tests and the docs' measured recipe

docs/post-training.md is the user page. The chat rendering itself is a core data module
(jaxinfra/data/chat.py); nothing here is imported unless the data is chat, except config.py.
"""
