from mmrl.train.config import TrainConfig
from mmrl.train.trainer import Trainer, train

__all__ = ["TrainConfig", "Trainer", "train"]
