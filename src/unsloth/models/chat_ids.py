"""`tokenizer.apply_chat_template(messages, return_tensors="pt")` returns the token ids, as in transformers 4.

Transformers 5 returns a BatchEncoding there unless `return_dict=False` is passed; notebooks written for
4 use the result as the ids tensor (`ids[0]`, `ids.shape[1]`, `output[:, ids.shape[1]:]`). Where the
installed transformers defaults `return_dict` to True (read off its signature), the tokenizers we load
default it to False again; a caller that passes it (TRL, transformers' pipelines: always) gets what it asks.
"""

from __future__ import annotations

import inspect
import types


def apply_chat_template(self, *args, **kwargs):  # the method's own name: a pickled tokenizer restores it
    kwargs.setdefault("return_dict", False)
    return type(self).apply_chat_template(self, *args, **kwargs)


def returns_ids_by_default(tokenizer) -> bool:
    """Give `tokenizer` transformers 4's default where transformers 5's applies; True if it was changed."""
    method = getattr(type(tokenizer), "apply_chat_template", None)
    if method is None or isinstance(tokenizer.__dict__.get("apply_chat_template"), types.MethodType):
        return False
    parameter = inspect.signature(method).parameters.get("return_dict")
    if parameter is None or parameter.default is not True:
        return False
    tokenizer.apply_chat_template = types.MethodType(apply_chat_template, tokenizer)
    return True
