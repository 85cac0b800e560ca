"""Training LFM2 models on lfm2jit kernels: Trainer, optimizers, schedules, loss scaling, sync, data."""
from .data import Batch
from .errors import TrainError
from .optim import SGD, AdamW, Optimizer
from .scaler import GradScaler
from .schedules import ConstantLR, CosineWithWarmup, LinearDecay, LinearWarmup, LRScheduler
from .sync import FileGradSyncConfig
from .trainer import StepStats, Trainer

__all__ = ["AdamW", "Batch", "ConstantLR", "CosineWithWarmup", "FileGradSyncConfig", "GradScaler", "LRScheduler",
           "LinearDecay", "LinearWarmup", "Optimizer", "SGD", "StepStats", "TrainError", "Trainer"]
