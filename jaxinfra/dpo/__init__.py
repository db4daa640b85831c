"""DPO (issue 29): see jaxinfra/dpo/extension.py."""
