"""Configuration: pydantic models per process, composed from TOML files and CLI flags.

See `base.py` for the model conventions and `cli.py` for how sources are merged; `defaults.py` holds
the defaults several processes' configs share, `plugins.py` how a config section picks a function
(a built-in by name, or yours by import path).
"""

from prime_rl.config.base import BaseConfig, RootConfig
from prime_rl.config.cli import ConfigError, parse_config, raise_problems

__all__ = ["BaseConfig", "ConfigError", "RootConfig", "parse_config", "raise_problems"]
