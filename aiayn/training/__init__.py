"""Training: the loop, label-smoothed loss, schedule, checkpoints, metrics, logs and plots."""

from aiayn.training.config import RunConfig, TrainConfig, load_run_config
from aiayn.training.loop import Trainer, TrainingError, TrainResult

__all__ = ["RunConfig", "TrainConfig", "TrainResult", "Trainer", "TrainingError", "load_run_config"]
