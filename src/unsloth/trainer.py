"""`from unsloth.trainer import UnslothVisionDataCollator, UnslothTrainer, ...`: the import path notebooks use."""

from unsloth.notebook.trainers import (  # noqa: F401
    UnslothTrainer,
    UnslothTrainingArguments,
    UnslothVisionDataCollator,
    unsloth_train,
)
