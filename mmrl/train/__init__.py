"""The training loop. ``mmrl.train.run_config`` is light; the trainer (accelerate, tensorboard)
loads on first use so that env worker processes importing configs stay fast."""

from mmrl.train.run_config import TrainConfig


def __getattr__(name):
    if name in ("Trainer", "train"):
        from mmrl.train import trainer

        return getattr(trainer, name)
    raise AttributeError(name)


__all__ = ["TrainConfig", "Trainer", "train"]
