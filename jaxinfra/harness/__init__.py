"""lm-evaluation-harness on jaxinfra models: the registered model `jaxinfra`, task runs, the CLI and
the in-training extension (docs/inference.md "Downstream tasks").

Nothing here imports lm_eval or jax at import time: `import jaxinfra.harness` works without the
optional extra, and only the code paths that run tasks call `require_lm_eval()` (one-line exit 2).
"""

from __future__ import annotations

import os
from types import ModuleType

from jaxinfra.config import ConfigError

INSTALL_HINT = "pip install 'jaxinfra[eval]'"


class HarnessError(ConfigError):
    """Bad lm-eval input (unknown task, missing include path, no lm-eval): one line, exit status 2."""


def require_lm_eval(what: str = "jaxinfra eval --tasks") -> ModuleType:
    """The lm_eval package, or HarnessError naming the extra to install. Task data must come from
    local files (no hub access at run time), so the hub is switched offline unless the user said otherwise."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import lm_eval
    except ImportError:
        raise HarnessError(f"{what} needs lm-evaluation-harness: {INSTALL_HINT}") from None
    return lm_eval
