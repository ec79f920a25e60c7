"""Export a fine-tuned model to GGUF and run it through llama.cpp.

The flow: merge LoRA adapters into 16-bit weights (``merge``) -> write GGUF with our own converter
on the ``gguf`` package (``converter``, ``architectures``, ``vocab``) -> quantize through llama.cpp
(``quantize``) -> compare greedy tokens with transformers (``validate``) -> optional Ollama
Modelfile (``modelfile``). ``gguf.save_pretrained_gguf`` runs the whole flow.

Importing this package is cheap: the heavy libraries (torch, transformers, gguf, llama_cpp) are
imported by the modules that need them.
"""

from unsloth.export.errors import ExportError

__all__ = ["ExportError"]
