"""The frozen input embedding in pinned host memory: same outputs, freed GPU memory, stays put."""

import copy

import pytest
import torch
from torch import nn

from tiny_families import VOCAB, tiny_model
from unsloth.models.embedding import (
    OffloadedEmbedding,
    _register_last,
    grad_mode_input_hooks,
    offload_input_embedding,
    require_grad_when_recorded,
)


def test_refused_with_a_reason_where_it_cannot_apply(monkeypatch):
    model = tiny_model("llama")
    model.requires_grad_(False)
    assert "not on a GPU" in offload_input_embedding(model)
    model.get_input_embeddings().weight.requires_grad_(True)
    assert "being trained" in offload_input_embedding(model)
    monkeypatch.setenv("UNSLOTH_OFFLOAD_EMBEDDING", "0")
    assert "UNSLOTH_OFFLOAD_EMBEDDING=0" in offload_input_embedding(model)
    assert type(model.get_input_embeddings()) is nn.Embedding


def test_tied_and_scaled_embeddings_stay():
    tied = tiny_model("llama").requires_grad_(False)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    assert "tied to the LM head" in offload_input_embedding(tied)
    scaled = tiny_model("gemma3_text").requires_grad_(False)  # multiplies by sqrt(hidden) in its forward
    assert "not a plain lookup" in offload_input_embedding(scaled)


def test_the_embedding_registered_last_is_no_longer_the_first_parameter():
    """What keeps `model.device` on the GPU once the table (its first parameter) is in host memory."""
    model = tiny_model("llama")
    embedding = model.get_input_embeddings()
    keys = set(model.state_dict())
    assert next(model.parameters()) is embedding.weight
    _register_last(model, embedding)
    assert next(model.parameters()) is not embedding.weight
    assert model.get_input_embeddings() is embedding and set(model.state_dict()) == keys
    ids = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():  # still the model's input layer
        assert torch.equal(model.model(input_ids=ids).last_hidden_state,
                           model.model(inputs_embeds=embedding(ids)).last_hidden_state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the table is read by a GPU over PCIe")
def test_offloaded_model_gives_the_same_logits_and_stays_offloaded():
    model = tiny_model("llama").cuda().requires_grad_(False)
    ids = torch.randint(0, VOCAB, (2, 9), device="cuda")
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    before = torch.cuda.memory_allocated()
    assert offload_input_embedding(model) is None
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, OffloadedEmbedding) and embedding.weight.is_pinned()
    assert torch.cuda.memory_allocated() < before
    assert model.device.type == "cuda"  # the first parameter is no longer the host table
    model.to("cuda")  # what a Trainer does: the table stays in host memory
    assert embedding.weight.device.type == "cpu"
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)
    model.to(torch.float16)
    assert embedding.weight.dtype == torch.float16 and embedding.weight.is_pinned()


ON = "cuda" if torch.cuda.is_available() else "cpu"  # where lookups land


def _offload_by_hand(embedding: nn.Embedding) -> OffloadedEmbedding:
    """`embedding` made an OffloadedEmbedding whose table is in CPU memory, pinned where a GPU reads it
    (on a machine without one the lookups stay on the CPU)."""
    if ON == "cuda":
        embedding.weight.data = embedding.weight.data.cpu().pin_memory()
    embedding.__class__ = OffloadedEmbedding
    embedding.compute_device = torch.device(ON)
    return embedding


def test_a_compiled_forward_looks_up_outside_its_graph_and_gives_the_same_logits():
    model = tiny_model("llama").requires_grad_(False).to(ON)
    model.enable_input_require_grads()
    grad_mode_input_hooks(model)
    ids = torch.randint(0, VOCAB, (2, 7), device=ON)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    _offload_by_hand(model.get_input_embeddings())
    explained = torch._dynamo.explain(lambda i: model(input_ids=i).logits)(ids)
    assert (explained.graph_count, explained.graph_break_count) == (2, 1)  # split once, at the lookup
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(lambda i: model(input_ids=i).logits)(ids), expected)


def test_a_copy_reads_its_own_table():
    embedding = _offload_by_hand(nn.Embedding(VOCAB, 16).requires_grad_(False))
    twin = copy.deepcopy(embedding)
    assert twin.weight.is_pinned() == (ON == "cuda")  # the GPU can read the copy's table too
    twin.weight.data.zero_()
    ids = torch.arange(4, device=ON)
    assert not twin(ids).any()
    assert torch.equal(embedding(ids).cpu(), embedding.weight[:4])


def test_the_input_grad_hook_is_kept_for_training_and_breaks_no_graph_without_grad():
    model = tiny_model("llama").requires_grad_(False)
    model.enable_input_require_grads()  # transformers' hook, as gradient checkpointing sets it
    ids = torch.randint(0, VOCAB, (1, 6))
    grad_mode_input_hooks(model)  # torch 2.11's dynamo breaks its graph at transformers' requires_grad_ call
    assert list(model.get_input_embeddings()._forward_hooks.values()) == [require_grad_when_recorded]
    forward = torch.compile(lambda i: model(input_ids=i).logits, fullgraph=True, backend="eager")
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        torch.testing.assert_close(forward(ids), expected, rtol=0, atol=0)
    assert model(input_ids=ids).logits.requires_grad  # training still gets an input that requires grad
    model.disable_input_require_grads()  # transformers' handles still remove it
    assert not model(input_ids=ids).logits.requires_grad
