"""Run configuration: the frozen dataclasses of every setting (sections.py, services.py, training.py), strict
YAML/JSON loading (load.py) and the value checks every config passes before it runs (checks.py,
checks_gpu.py).

May import: nothing of relax_core, and neither torch nor flytekit: a config can be checked
anywhere, in milliseconds.
"""

from relax_core.config.load import (
    ConfigError,
    RunConfig,
    config_from_dict,
    config_to_dict,
    load_config,
    replace,
)
from relax_core.config.sections import (
    AlgorithmConfig,
    CheckpointConfig,
    DataConfig,
    EnvConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrackingConfig,
    WarmStartConfig,
)
from relax_core.config.services import QueueConfig, ServicesConfig, SGLangConfig, VLLMConfig
from relax_core.config.training import LoraConfig, ParallelConfig, TrainConfig

__all__ = [
    "AlgorithmConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "EnvConfig",
    "LoraConfig",
    "ModelConfig",
    "ParallelConfig",
    "QueueConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SGLangConfig",
    "ServicesConfig",
    "TrackingConfig",
    "TrainConfig",
    "VLLMConfig",
    "WarmStartConfig",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "replace",
]
