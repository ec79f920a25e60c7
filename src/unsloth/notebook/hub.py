"""`push_to_hub_merged` / `push_to_hub_gguf`: save into a temporary folder, then upload it in one commit.

Reachability is checked before anything is written, so an offline machine gets one clear error and
no half-made files or repositories.
"""

from __future__ import annotations

import os
import tempfile

from unsloth.errors import UnslothError

HUB = "huggingface.co"


class HubError(UnslothError):
    pass


def require_hub(action: str) -> None:
    """Refuse early, naming the cause, when the Hugging Face hub cannot be reached."""
    import socket

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise HubError(f"{action}: HF_HUB_OFFLINE is set, so nothing can be uploaded; nothing was written",
                       fix="unset HF_HUB_OFFLINE, or save locally (save_pretrained_merged / save_pretrained_gguf)")
    try:
        socket.create_connection((HUB, 443), timeout=5).close()
    except OSError as exc:
        raise HubError(f"{action}: {HUB} cannot be reached from this machine ({exc}); nothing was written or "
                       "uploaded", fix="connect this machine to the internet, or save locally with "
                       "save_pretrained_merged(dir, tokenizer) / save_pretrained_gguf(dir, tokenizer)") from None


def _upload(folder: str, repo_id: str, token, private, commit_message: str) -> str:
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message)
    return repo_id


def push_to_hub_merged(model, repo_id: str, tokenizer=None, save_method: str = "merged_16bit", token=None,
                       private=None, commit_message: str = "Upload model trained with unsloth", **kwargs):
    require_hub("push_to_hub_merged")
    with tempfile.TemporaryDirectory(prefix="unsloth-push-") as folder:
        model.save_pretrained_merged(folder, tokenizer, save_method=save_method, **kwargs)
        return _upload(folder, repo_id, token, private, commit_message)


def push_to_hub_gguf(model, repo_id: str, tokenizer=None, quantization_method="q8_0", token=None,
                     private=None, commit_message: str = "Upload GGUF trained with unsloth", **kwargs):
    require_hub("push_to_hub_gguf")
    with tempfile.TemporaryDirectory(prefix="unsloth-push-") as folder:
        model.save_pretrained_gguf(folder, tokenizer, quantization_method=quantization_method, **kwargs)
        return _upload(folder, repo_id, token, private, commit_message)
