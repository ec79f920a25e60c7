"""Routed experts: a MoE block's experts run as our grouped-GEMM kernel (unsloth_kernels.moe).

transformers stores the experts of gpt-oss, Qwen3-MoE, Qwen3.5-MoE, Gemma 4, DeepSeek-V3, GLM-4
MoE and others as one module holding packed (E, ...) `gate_up_proj` and `down_proj` stacks,
called as `experts(hidden_states, top_k_index, top_k_weights)`. Only that module is replaced: the
router (and so the auxiliary loss the model computes from its logits) and any shared experts stay
the model's own (a shared expert is a plain gated MLP, which the MLP patch handles). Which
activation, gate/up layout, orientation and biases a module uses is found by behaviour: each
candidate runs on a probe input and is kept only if it gives the module's own output.

With peft, experts are adapted through `target_parameters` (one `ParamWrapper` per targeted stack,
nested); their forward would add the dense delta B A to every expert's weights on each call. The
outermost wrapper's forward is replaced instead: the LoRA factors go to the kernel, which adds
the low-rank term in its GEMM epilogue. Anything the fast path does not cover (several active
adapters, disabled or merged adapters) falls back to peft's own forward on every call.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from unsloth.models.experts_4bit import Nf4Stack
from unsloth.models.patches.probe import same

# Parameter names of the packed stacks, as `target_parameters` entries (peft matches by suffix).
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
# target_modules names that mean "the experts' MLP" in a dense-model notebook
_MLP_TARGETS = {"gate_proj", "up_proj", "down_proj", "gate_up_proj"}
_ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh", "gpt_oss")


def is_packed_experts(module: nn.Module) -> bool:
    """A transformers experts module of packed stacks with the (hidden, top_k_index, top_k_weights) call."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
            and down.dim() == 3 and getattr(module, "has_gate", False) and not getattr(module, "has_post_expert_norm", False)
            and hasattr(module, "num_experts"))  # fmt: skip


def _spec_candidates(module):
    transposed = bool(getattr(module, "is_transposed", False))
    concatenated = getattr(module, "is_concatenated", True)
    layouts = ("concatenated", "interleaved") if concatenated is None else (
        ("concatenated",) if concatenated else ("interleaved",))  # fmt: skip
    extra = {"alpha": float(getattr(module, "alpha", 1.702)), "limit": float(getattr(module, "limit", 7.0))}
    for activation in _ACTIVATIONS:
        for layout in layouts:
            yield {"activation": activation, "layout": layout, "transposed": transposed, **extra}


def _expert_weights(module, spec, lora=None):
    from unsloth_kernels.moe import ExpertWeights

    lora = lora or {}
    stacks = []
    for name in ("gate_up_proj", "down_proj"):
        A, B, scaling = lora.get(name, (None, None, 1.0))
        bias = getattr(module, f"{name}_bias", None) if getattr(module, "has_bias", False) else None
        weight = getattr(module, name)
        quant_state = None
        if isinstance(weight, Nf4Stack):  # QLoRA: the kernel reads the NF4 bytes
            weight, quant_state = weight.packed, weight.quant_state
        stacks.append(ExpertWeights(weight, A, B, scaling, bias, transposed=spec["transposed"], quant_state=quant_state))
    return stacks


def _run(module, spec, hidden_states, top_k_index, top_k_weights, lora=None):
    from unsloth_kernels.moe import moe_experts

    gate_up, down = _expert_weights(module, spec, lora)
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    out = moe_experts(x, top_k_index.reshape(x.shape[0], -1), top_k_weights.reshape(x.shape[0], -1), gate_up, down,
                      activation=spec["activation"], layout=spec["layout"], alpha=spec["alpha"], limit=spec["limit"])  # fmt: skip
    return out.view_as(hidden_states)


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    return _run(self, self._unsloth_moe, hidden_states, top_k_index, top_k_weights)


def _probe_routing(module, tokens, device, dtype):
    generator = torch.Generator().manual_seed(0)
    experts = module.num_experts
    k = min(2, experts)
    index = torch.randn(tokens, experts, generator=generator).topk(k, dim=-1).indices.to(device)
    weights = torch.softmax(torch.randn(tokens, k, generator=generator), dim=-1).to(device, dtype)
    return index, weights


def patch_moe_experts(model: nn.Module, device, dtype) -> int:
    """Give every packed experts module whose behaviour we reproduce the grouped-GEMM forward."""
    patched = patch_dense_routed_moe(model, device, dtype)
    for module in model.modules():
        if not is_packed_experts(module) or "_unsloth_moe" in module.__dict__:
            continue
        hidden = module.down_proj.shape[1] if not getattr(module, "is_transposed", False) else module.down_proj.shape[2]
        x = torch.randn(16, hidden, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        index, weights = _probe_routing(module, 16, device, dtype)
        with torch.no_grad():
            expected = module(x, index, weights)
            for spec in _spec_candidates(module):
                try:
                    ok = same(_run(module, spec, x, index, weights), expected)
                except (ValueError, RuntimeError):
                    ok = False
                if ok:
                    module._unsloth_moe = spec
                    module.forward = types.MethodType(_experts_forward, module)
                    patched += 1
                    break
    return patched


# --- Llama 4: every expert runs over every token, inputs scaled by the router's scores --------------


def is_dense_routed_moe(module: nn.Module) -> bool:
    """A MoE block (Llama 4's) whose experts module takes (E * T, H) inputs, every token repeated for
    every expert and scaled by its (zero off the top-k) sigmoid score, and whose `router` returns
    (scores (T, E), logits (T, E)); a shared expert is added to the sum."""
    experts, router = getattr(module, "experts", None), getattr(module, "router", None)
    gate_up = getattr(experts, "gate_up_proj", None)
    return (isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3 and isinstance(router, nn.Linear)
            and hasattr(module, "shared_expert") and hasattr(module, "top_k") and not is_packed_experts(experts))  # fmt: skip


def _dense_routed_forward(self, hidden_states):
    """The block's math with only the top-k experts of each token run (the others' inputs are
    zero, and so are their outputs: no biases), as one grouped GEMM over the (token, expert) pairs."""
    x = hidden_states.reshape(-1, self.hidden_dim)
    scores, logits = self.router(x)
    index = logits.topk(self.top_k, dim=1).indices
    picked = scores.gather(1, index)
    # the score scales the expert's input, not its output: each pair gets its own scaled row
    pairs = (x.unsqueeze(1) * picked.unsqueeze(-1)).reshape(-1, x.shape[-1])
    ones = torch.ones(pairs.shape[0], 1, device=x.device, dtype=x.dtype)
    routed = self.experts(pairs, index.reshape(-1, 1), ones).view(x.shape[0], self.top_k, -1).sum(1)
    return self.shared_expert(x) + routed, logits


def patch_dense_routed_moe(model: nn.Module, device, dtype) -> int:
    """Llama 4's MoE blocks: the block's forward routes only the top-k pairs to our kernel; its
    experts module takes our (hidden, top_k_index, top_k_weights) call (so peft's wrappers, the
    LoRA fast path and the 4-bit stacks treat it as the other families' experts)."""
    patched = 0
    for block in model.modules():
        if not is_dense_routed_moe(block) or "_unsloth_moe" in block.experts.__dict__:
            continue
        experts = block.experts
        x = torch.randn(16, block.hidden_dim, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        spec_base = {"transposed": True, "alpha": 1.702, "limit": 7.0}
        with torch.no_grad():
            expected = block(x)
            for activation in _ACTIVATIONS:
                experts._unsloth_moe = {**spec_base, "activation": activation, "layout": "concatenated"}
                experts.forward = types.MethodType(_experts_forward, experts)
                try:
                    ok = same(_dense_routed_forward(block, x), expected)
                except (ValueError, RuntimeError):
                    ok = False
                if ok:
                    block.forward = types.MethodType(_dense_routed_forward, block)
                    patched += 1
                    break
                del experts._unsloth_moe, experts.forward
    return patched


def holds_expert_stacks(module: nn.Module) -> bool:
    """A module holding packed (E, ...) gate_up_proj / down_proj stacks, told from the module alone (while
    a checkpoint loads, before the block around it is whole): what `experts_modules` finds, and more."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
            and down.dim() == 3 and hasattr(module, "num_experts"))  # fmt: skip


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """Every experts module of packed stacks in `model` (patched or not): the other families' and Llama 4's."""
    found = [m for m in model.modules() if is_packed_experts(m)]
    return found + [m.experts for m in model.modules() if is_dense_routed_moe(m)]


# --- peft: experts adapted through target_parameters --------------------------------------------


def expert_lora_factors(wrapper):
    """(experts module, {stack name: (A (E, r, in), B (E, out, r), scaling)}) of a chain of peft
    ParamWrappers around a patched experts module, or None when the fast path does not apply now."""
    from peft.tuners.lora import ParamWrapper

    factors = {}
    module = wrapper
    while isinstance(module, ParamWrapper):
        if module.merged or module.disable_adapters:
            return None
        adapters = module.active_adapters
        if len(adapters) != 1 or adapters[0] not in module.lora_A:
            return None
        name = adapters[0]
        A, B = module.lora_A[name].weight, module.lora_B[name].weight
        experts, rank = module.num_experts, module.r[name]
        if module.lora_B[name].bias is not None or not isinstance(module.lora_dropout[name], nn.Identity):
            return None
        factors[module.parameter_name] = (A.view(experts, rank, A.shape[1]), B.view(B.shape[0], rank, experts).permute(2, 0, 1),
                                          float(module.scaling[name]), module._did_swap_in_out_features)  # fmt: skip
        module = module.base_layer
    if "_unsloth_moe" not in module.__dict__ or not set(factors) <= {"gate_up_proj", "down_proj"}:
        return None
    transposed = module._unsloth_moe["transposed"]
    return module, {name: _kernel_factors(*f, transposed) for name, f in factors.items()}


def _kernel_factors(A, B, scaling, peft_swapped: bool, transposed: bool):
    """(A (E, r, in), B (E, out, r), scaling) for the kernel from peft's factors.

    peft reads a stack as (E, in, out) when its module says `is_transposed`, else as (E, out, in)
    (it "swaps"). Where that disagrees with the stack's real orientation (Llama 4's (E, in, out)
    stacks have no such attribute), peft's delta B A lies in the stored orientation, (in, out),
    so the kernel's (out, in) delta is its transpose: A^T and B^T trade places."""
    if peft_swapped == transposed:
        return B.transpose(1, 2), A.transpose(1, 2), scaling
    return A, B, scaling


def _lora_experts_forward(self, hidden_states, top_k_index=None, top_k_weights=None, *args, **kwargs):
    found = None if (args or kwargs or top_k_index is None) else expert_lora_factors(self)
    if found is None:
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    experts, factors = found
    return _run(experts, experts._unsloth_moe, hidden_states, top_k_index, top_k_weights, factors)


def patch_moe_lora(model) -> int:
    """Route the outermost peft ParamWrapper around each patched experts module through the kernel."""
    from peft.tuners.lora import ParamWrapper

    inner = {id(m.base_layer) for m in model.modules() if isinstance(m, ParamWrapper)}
    patched = 0
    for module in model.modules():
        if isinstance(module, ParamWrapper) and id(module) not in inner and expert_lora_factors(module) is not None:
            module.forward = types.MethodType(_lora_experts_forward, module)
            patched += 1
    return patched


def expert_target_parameters(model, target_modules) -> list[str]:
    """The packed expert stacks LoRA should adapt, given a notebook's target_modules.

    Dense-model notebooks name gate_proj / up_proj / down_proj; in a model whose experts are packed
    stacks those are `experts.gate_up_proj` / `experts.down_proj`, which peft reaches only
    through `target_parameters`."""
    if not target_modules or not _MLP_TARGETS & set(target_modules):
        return []
    if not experts_modules(model):
        return []
    wanted = set(target_modules)
    names = []
    if wanted & {"gate_proj", "up_proj", "gate_up_proj"}:
        names.append(EXPERT_PARAMETERS[0])
    if "down_proj" in wanted:
        names.append(EXPERT_PARAMETERS[1])
    return names
