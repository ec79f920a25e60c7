"""`from unsloth.chat_templates import get_chat_template, ...`: the import path notebooks already use."""

from unsloth.training.chat_templates import (  # noqa: F401
    get_chat_template,
    standardize_sharegpt,
    train_on_responses_only,
)
