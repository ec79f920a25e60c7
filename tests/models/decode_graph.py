"""Trace a tiny QLoRA Llama's decode step with dynamo as a GPU would, and print what it made (JSON).

Run in a process without TRITON_INTERPRET (tests/models/test_models_nf4_decode.py does), so the
kernels import as they do on a GPU and nf4_matmul is the `triton_op` torch.compile traces into (under
the interpreter it is an opaque custom op with a fake, which hides faults of the GPU form: a launch
that reads a tensor's values under fake tensors breaks the graph). Nothing is launched: the backend
records each graph and stops. Prints {"triton_op": whether the op is in that form, "graphs": [nodes
of each], "nf4_matmul": calls in them ("partials": of those, the first pass alone: nf4_matmul.SUM_IN_GRAPH),
"linear": torch linears in them, "breaks": graph breaks}.
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))


def main() -> None:
    from tiny_families import save_tiny
    from torch._dynamo.utils import counters
    from torch._library.triton import triton_ops_to_kernels
    from transformers import StaticCache
    from unsloth_kernels import _utils, nf4_matmul  # noqa: F401 - imported before INTERPRET is set below

    from unsloth.models.loader import add_lora, load_pretrained
    from unsloth.models.patches.lora import patch_lora

    with tempfile.TemporaryDirectory() as tmp:
        # the kernels do not run on this CPU without the interpreter: the load applies no patches
        model, _ = load_pretrained(str(save_tiny("llama", pathlib.Path(tmp) / "llama")), max_seq_length=64,
                                   dtype="bfloat16", load_in_4bit=True)  # fmt: skip
    model = add_lora(model, r=4, lora_alpha=8, random_state=0).eval()
    _utils.INTERPRET = True  # the decode path's "can the kernels run here" check only; the op stays a triton_op
    patch_lora(model)
    graphs = []

    class Captured(Exception):
        pass

    def backend(gm, example_inputs):
        graphs.append(gm)
        raise Captured  # nothing runs: a graph break would have compiled a partial graph before this

    cache = StaticCache(config=model.config, max_cache_len=32)
    step = torch.compile(model.forward, backend=backend, dynamic=False)
    with torch.no_grad():
        try:
            step(input_ids=torch.randint(2, 100, (4, 1)), past_key_values=cache, cache_position=torch.tensor([0]),
                 use_cache=True)  # fmt: skip
        except Exception:  # dynamo wraps what the backend raises; anything before a capture is a fault
            if not graphs:
                raise
    print(json.dumps({"triton_op": "unsloth::nf4_matmul" in triton_ops_to_kernels,
                      "graphs": [len(g.graph.nodes) for g in graphs],
                      "nf4_matmul": sum("nf4_matmul" in str(n.target) for g in graphs for n in g.graph.nodes),
                      "partials": sum("nf4_matmul_partials" in str(n.target) for g in graphs for n in g.graph.nodes),
                      "linear": sum(n.target is torch.nn.functional.linear for g in graphs for n in g.graph.nodes),
                      "breaks": sum(counters["graph_break"].values())}))


if __name__ == "__main__":
    main()
