"""Run configuration: the frozen dataclasses of every setting (sections.py, services.py), strict
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
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    TrackingConfig,
    TrainConfig,
    WarmStartConfig,
)
from relax_core.config.services import QueueConfig, ServicesConfig, SGLangConfig, VLLMConfig

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
