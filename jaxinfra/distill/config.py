"""The `distill` section of the run config: defined in jaxinfra/config_sections.py (the run config
embeds it and the core never imports a feature package); re-exported here for distill/'s modules."""

from jaxinfra.config_sections import DistillConfig, DistillSchedule, TeacherDType

__all__ = ["DistillConfig", "DistillSchedule", "TeacherDType"]
