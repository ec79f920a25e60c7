"""`from unsloth.chat_templates import get_chat_template, ...`: the import path notebooks already use."""

from unsloth.training.chat_templates import (  # noqa: F401
    TEMPLATES as CHAT_TEMPLATES,
    apply_chat_template,
    get_chat_template,
    standardize_data_formats,
    standardize_sharegpt,
    to_sharegpt,
    train_on_responses_only,
)
