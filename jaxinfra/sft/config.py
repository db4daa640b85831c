"""The `sft` section of the run config: defined in jaxinfra/config_sections.py (the run config
embeds it and the core never imports a feature package); re-exported here for sft/'s modules."""

from jaxinfra.config_sections import SftConfig, TrainOn

__all__ = ["SftConfig", "TrainOn"]
