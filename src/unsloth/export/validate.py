"""Does the GGUF behave like the model it came from? Greedy tokens in llama.cpp vs transformers.

For each prompt, transformers generates the reference greedy tokens; llama.cpp then reads the same
prompt + reference (teacher forcing) and its top-1 choice at every step is compared. All steps
agreeing is the same as identical greedy output; a fraction is a fair agreement score for
quantized files, unaffected by one early divergence. A disagreement where transformers' own top
two logits are closer than the reference's numerical noise counts as a near tie, not an error.
The tokenizer is checked too: same ids for the same text, same text back from the ids.
llama.cpp's side runs in a child process (validate_child), so an abort in llama.cpp cannot take the
caller's Python and model with it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from unsloth.export import runtime, validate_child

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "Q: What is 12 times 7?\nA:",
)
# Text that stresses the tokenizer: whitespace runs, digits, accents, CJK, emoji, code.
TOKENIZER_SAMPLES = (
    "Hello world",
    "  leading spaces\tand\ttabs\n\nnew lines  ",
    "numbers 1 12 123 1234 12345 3.14159",
    "accents: café naïve über, CJK: 我想在工作, emoji: 🦙🚀",
    "it's we'll they're I'VE",
    "def f(x):\n    return x ** 2  # square",
)
N_TOKENS = 16
# Agreement a quantized export should reach on a real model; reported, and a warning below it.
QUANT_THRESHOLDS = {"q8_0": 0.9, "q6_k": 0.8, "q5_k_m": 0.75, "q5_k_s": 0.75, "q5_0": 0.75, "q4_k_m": 0.6, "q4_k_s": 0.6, "q4_0": 0.6}
# A swap of llama.cpp's and transformers' choices is a near tie when transformers' own logits for
# the two differ by less than this fraction of that step's logit range. llama.cpp's f16 compute
# moves logits by about 0.1-0.3% of the range; a bf16/f16 reference adds its own rounding.
TIE_TOLERANCE = {torch.float32: 0.01, torch.bfloat16: 0.05, torch.float16: 0.03}


@dataclass
class PromptResult:
    prompt: str
    reference: list[int]  # transformers' greedy tokens
    candidate: list[int]  # llama.cpp's top-1 at each step, given the same prefix
    gaps: list[float]  # reference logit of its choice minus that of llama.cpp's, over the logit range

    def near_ties(self, tolerance: float) -> int:
        return sum(1 for r, c, g in zip(self.reference, self.candidate, self.gaps) if r != c and g < tolerance)

    @property
    def matches(self) -> int:
        return sum(r == c for r, c in zip(self.reference, self.candidate))


@dataclass
class Validation:
    method: str
    file: str
    prompts: list[PromptResult]
    tie_tolerance: float
    reference_dtype: str
    tokenizer_mismatches: list[str] = field(default_factory=list)

    @property
    def agreement(self) -> float:
        total = sum(len(p.reference) for p in self.prompts)
        return sum(p.matches for p in self.prompts) / total if total else 1.0

    @property
    def identical(self) -> bool:
        return all(p.matches == len(p.reference) for p in self.prompts)

    @property
    def threshold(self) -> float | None:
        return 1.0 if self.method in ("f32", "f16", "bf16") else QUANT_THRESHOLDS.get(self.method)

    @property
    def passed(self) -> bool:
        if self.tokenizer_mismatches:
            return False
        if self.method in ("f32", "f16", "bf16"):  # exact weights: only near ties may differ
            return all(p.matches + p.near_ties(self.tie_tolerance) == len(p.reference) for p in self.prompts)
        return self.threshold is None or self.agreement >= self.threshold

    def summary(self) -> str:
        verdict = "ok" if self.passed else "FAILED"
        ties = sum(p.near_ties(self.tie_tolerance) for p in self.prompts)
        text = (
            f"{self.method}: greedy agreement with transformers {self.agreement:.1%} over "
            f"{len(self.prompts)} prompts x {len(self.prompts[0].reference) if self.prompts else 0} tokens"
        )
        if ties:
            text += f" ({ties} near ties)"
        if self.threshold is not None and self.threshold < 1:
            text += f", threshold {self.threshold:.0%}"
        if self.tokenizer_mismatches:
            text += f"; tokenizer differs on {len(self.tokenizer_mismatches)} samples"
        return f"{text} -> {verdict}"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(agreement=self.agreement, identical=self.identical, passed=self.passed, threshold=self.threshold)
        return data


def reference_model(model: Any) -> Any:
    """The model to compare against: itself if float32, else a float32 CPU copy when that is cheap."""
    params = list(model.parameters())
    if all(p.dtype == torch.float32 for p in params):
        return model
    on_cpu = all(p.device.type == "cpu" for p in params)
    packed = any(not p.is_floating_point() for p in params)  # 4-bit weights cannot be upcast
    if on_cpu and not packed:
        import psutil

        if sum(p.numel() for p in params) * 4 < psutil.virtual_memory().available * 0.5:
            return copy.deepcopy(model).to(torch.float32)
    return model  # compare in the model's own precision (see TIE_TOLERANCE)


@torch.no_grad()
def reference_greedy(model: Any, prompt: list[int], n_tokens: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens from transformers and the logits at each step (ignores end-of-sequence)."""
    device = next(model.parameters()).device
    tokens: list[int] = []
    logits = []
    for _ in range(n_tokens):  # no KV cache: a few short steps, and no cache API to depend on
        out = model(input_ids=torch.tensor([prompt + tokens], device=device), use_cache=False)
        step = out.logits[0, -1].float().cpu()
        tokens.append(int(step.argmax()))
        logits.append(step.numpy())
    return tokens, np.stack(logits)


@dataclass
class Reference:
    """transformers' side of the comparison, computed once and reused for every exported file."""

    texts: list[str]
    prompts: list[list[int]]  # token ids, as transformers' tokenizer gives them
    tokens: list[list[int]]  # greedy continuation of each prompt
    logits: list[np.ndarray]  # logits at each continuation step
    tie_tolerance: float
    dtype: str


def reference_run(model: Any, tokenizer: Any, prompts: tuple[str, ...] = DEFAULT_PROMPTS, n_tokens: int = N_TOKENS) -> Reference:
    model = reference_model(model).eval()
    dtype = next(model.parameters()).dtype
    texts = list(prompts) + [t for t in [chat_prompt(tokenizer)] if t]
    # A rendered chat prompt already starts with the BOS text when the template writes it.
    encoded = [tokenizer(t, add_special_tokens=not t.startswith(tokenizer.bos_token or "\0"))["input_ids"] for t in texts]
    runs = [reference_greedy(model, ids, n_tokens) for ids in encoded]
    return Reference(
        texts, encoded, [r[0] for r in runs], [r[1] for r in runs],
        TIE_TOLERANCE.get(dtype, 0.05), str(dtype).removeprefix("torch."),
    )


def compare_prompt(text: str, reference: list[int], candidate: list[int], ref_logits: np.ndarray) -> PromptResult:
    """llama.cpp's top-1 choices (``candidate``) against transformers' greedy tokens and logits."""
    spread = ref_logits.max(axis=-1) - ref_logits.min(axis=-1)
    gaps = [float((ref_logits[i, r] - ref_logits[i, c]) / spread[i]) for i, (r, c) in enumerate(zip(reference, candidate))]
    return PromptResult(text, reference, candidate, gaps)


def tokenizer_mismatches(tokenizer: Any, samples: list[str], llama_cpp: list[tuple[list[int], str]]) -> list[str]:
    """``llama_cpp``: for each sample, llama.cpp's ids and the text it decodes them back to."""
    problems = []
    sentencepiece = _sentencepiece_encoder(tokenizer)
    for text, (theirs, back) in zip(samples, llama_cpp):
        ours = tokenizer(text)["input_ids"]
        if ours != theirs and sentencepiece is not None and sentencepiece(text, ours) == theirs:
            continue  # llama.cpp follows SentencePiece itself where transformers departs from it
        if ours != theirs:
            problems.append(f"encode {text!r}: transformers {ours} != llama.cpp {theirs}")
            continue
        if back != tokenizer.decode(ours):
            problems.append(f"decode {text!r}: transformers {tokenizer.decode(ours)!r} != llama.cpp {back!r}")
    return problems


def _sentencepiece_encoder(tokenizer: Any):
    """``(text, transformers' ids) -> ids`` from the tokenizer's own SentencePiece model, or None.

    SentencePiece encodes the text between added tokens piece by piece, each with its "▁" prefix
    (as transformers' legacy Llama tokenizer did, and llama.cpp does); transformers 5 drops that
    prefix after an added token and before text that starts with a space. A GGUF that tokenizes
    as the model's own SentencePiece model does is accepted."""
    import re

    from unsloth.models.tokenizer_files import sentencepiece_model

    path = sentencepiece_model(tokenizer)
    if path is None:
        return None
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
    added = dict(getattr(tokenizer, "added_tokens_encoder", {}))
    split = re.compile("(" + "|".join(map(re.escape, sorted(added, key=len, reverse=True))) + ")") if added else None

    def encode(text: str, ours: list[int]) -> list[int]:
        ids = ours[:1] if ours and ours[0] == tokenizer.bos_token_id and len(ours) > len(
            tokenizer(text, add_special_tokens=False)["input_ids"]) else []
        for part in split.split(text) if split else [text]:
            if part in added:
                ids.append(added[part])
            elif part:
                ids.extend(processor.encode(part))
        return ids

    return encode


def chat_prompt(tokenizer: Any) -> str | None:
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def validate(reference: Reference, tokenizer: Any, path: Path, method: str) -> Validation:
    """Compare the GGUF at ``path`` with ``reference`` (see ``reference_run``). llama.cpp runs in a
    child process (validate_child): if it dies there, ValidationCrashed says so and this one lives on."""
    n_ctx = max(len(p) + len(t) for p, t in zip(reference.prompts, reference.tokens)) + 8
    samples = list(TOKENIZER_SAMPLES) + list(reference.texts)
    answer = validate_child.run({
        "check": "tokens", "file": str(path), "n_ctx": n_ctx, "samples": samples,
        "sequences": [prompt + tokens[:-1] for prompt, tokens in zip(reference.prompts, reference.tokens)],
        "starts": [len(prompt) - 1 for prompt in reference.prompts],
    }, path)
    results = [compare_prompt(*args) for args in zip(reference.texts, reference.tokens, answer["candidates"], reference.logits)]
    mismatches = tokenizer_mismatches(tokenizer, samples, answer["tokenized"])
    return Validation(method, str(path), results, reference.tie_tolerance, reference.dtype, mismatches)


@dataclass
class ProjectorCheck:
    """The projector file (mmproj) of a vision-language export, checked: read with the gguf package
    (a clip file with a vision encoder, its projector type, every block of the tower, as many weights
    as the model's vision tower and projector hold), then, where llama-cpp-python has llama.cpp's
    multimodal library, loaded beside the language model's GGUF with an image run through both."""

    file: str
    projector_type: str | None
    blocks: int
    expected_blocks: int | None
    weights: int
    expected_weights: int
    image_tokens: int | None = None  # prompt tokens one image added in llama.cpp; None: not run here
    reply_tokens: int | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        if self.image_tokens is not None:
            ran = f"; llama.cpp ran an image through it ({self.image_tokens} image tokens, {self.reply_tokens} reply tokens)"
        else:
            ran = "" if self.problems else "; not run (llama-cpp-python has no multimodal library here)"
        verdict = "ok" if self.passed else "FAILED: " + "; ".join(self.problems)
        return (f"mmproj ({self.projector_type}): {self.blocks} vision blocks, {self.weights} weights{ran} "
                f"-> {verdict}")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def _vision_depth(config: Any) -> int | None:
    vision = getattr(config, "vision_config", None)
    for key in ("depth", "num_hidden_layers"):
        if isinstance(getattr(vision, key, None), int):
            return getattr(vision, key)
    return None


def check_projector(model: Any, text_path: Path, mmproj_path: Path) -> ProjectorCheck:
    """See ProjectorCheck. `model` is the exported (merged or adapted) vision-language model."""
    import gguf

    from unsloth.models.merge import base_model, merged_tensors
    from unsloth.models.vision import is_audio_module, is_vision_module

    reader = gguf.GGUFReader(str(mmproj_path))
    fields = {key: reader.fields[key].contents() for key in reader.fields if not key.startswith("GGUF.")}
    blocks = {int(t.name.split(".")[2]) for t in reader.tensors if t.name.startswith("v.blk.")}
    audio = bool(fields.get("clip.has_audio_encoder"))  # Gemma 4 E2B / E4B: the audio tower goes in too
    expected = sum(math.prod(t.shape) for name, t in merged_tensors(model).items()
                   if is_vision_module(name) or (audio and is_audio_module(name)))
    projector = fields.get("clip.vision.projector_type", fields.get("clip.projector_type"))  # newer: per encoder
    check = ProjectorCheck(str(mmproj_path), projector, len(blocks),
                           _vision_depth(base_model(model).config), sum(int(np.prod(t.shape)) for t in reader.tensors),
                           expected)
    if fields.get("general.architecture") != "clip" or not fields.get("clip.has_vision_encoder"):
        check.problems.append("not a clip file with a vision encoder")
    if check.expected_blocks is not None and blocks != set(range(check.expected_blocks)):
        check.problems.append(f"vision blocks {sorted(blocks)} in the file, {check.expected_blocks} in the model")
    if check.weights != check.expected_weights:
        towers = "vision and audio towers and projectors" if audio else "vision tower and projector"
        check.problems.append(f"{check.weights} weights in the file, {check.expected_weights} in the model's {towers}")
    if not check.problems and runtime.multimodal_available():
        ran = validate_child.run({"check": "image", "file": str(text_path), "mmproj": str(mmproj_path)}, mmproj_path,
                                 also=(text_path,))
        check.image_tokens, check.reply_tokens = ran["image_tokens"], ran["reply_tokens"]
        if check.image_tokens <= 0 or check.reply_tokens <= 0:
            check.problems.append("llama.cpp took no image tokens or gave no reply")
    return check
