"""GRPO (issue 29): see jaxinfra/grpo/extension.py."""
