"""Configuration: pydantic models, layered sources (defaults, file, environment, --set),
and cross-field validation against the installed plugins."""

from shardline.config.loader import LoadedConfig, load_config
from shardline.config.schema import EngineConfig

__all__ = ["EngineConfig", "LoadedConfig", "load_config"]
