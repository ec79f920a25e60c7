"""The chunked gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next) in plain torch, for machines
without flash-linear-attention's kernel. Autograd runs through it.

The recurrence, per head, with state S of shape [k_dim, v_dim] and q scaled by k_dim ** -0.5:
    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = S_t^T q_t
Inside a chunk of C steps starting from state S, with G the chunk's running sum of g, the u's solve
    (I + L) U = beta V - diag(beta exp(G)) K S,   L_ij = beta_i exp(G_i - G_j) k_i . k_j  (j < i),
so with T = (I + L)^-1 (one triangular solve for the whole batch of chunks: the WY / UT form)
U = T beta V - T diag(beta exp(G)) K S: the two T products need no state and are done for all chunks
at once; a loop carries the state from chunk to chunk and reads it there (exp(G) q . S), so that no
stack of the states is kept for the backward. It walks the chunks with unbind and gathers with stack
(not indexed reads and writes of a buffer, whose backward touches the whole buffer once per chunk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           **_) -> tuple[torch.Tensor, torch.Tensor | None]:
    """query, key [batch, seq, k_heads, k_dim]; value [batch, seq, v_heads, v_dim]; g (log decay, <= 0)
    and beta [batch, seq, v_heads]; initial_state [batch, v_heads, k_dim, v_dim]. Returns the output
    [batch, seq, v_heads, v_dim] in query's dtype and the final state (float32) when asked for.
    Computed in float32. Each k head serves v_heads // k_heads consecutive v heads. Extra keyword
    arguments (what transformers' layers pass along) are ignored, as transformers' torch rule does."""
    dtype = query.dtype
    batch, length, k_heads, k_dim = key.shape
    v_heads, v_dim = value.shape[-2:]
    if v_heads != k_heads:
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    # [batch, heads, seq, ...] in float32
    q, k, v = (x.transpose(1, 2).float() for x in (query, key, value))
    g, beta = (x.transpose(1, 2).float() for x in (g, beta))
    if use_qk_l2norm_in_kernel:  # eps inside the root, as fla does
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + 1e-6)
    q = q * k_dim ** -0.5

    # zero padding to whole chunks: beta = 0 writes nothing, g = 0 decays nothing
    pad = -length % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    chunks = (length + pad) // chunk_size
    q, k, v = (x.reshape(batch, v_heads, chunks, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(batch, v_heads, chunks, chunk_size) for x in (g, beta))

    G = g.cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i; masked before the exp, where G_i - G_j > 0 could overflow
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    # L's strict lower triangle; unitriangular=True reads only that and takes the diagonal as 1
    lower = (k_beta @ k.transpose(-1, -2)) * decay
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    t = torch.linalg.solve_triangular(lower, eye.expand_as(lower), upper=False, unitriangular=True)
    u = t @ (v * beta.unsqueeze(-1))  # U for a zero start state
    w = t @ (k_beta * G.exp().unsqueeze(-1))  # what a start state S takes from it: U = u - w S

    state = (torch.zeros(batch, v_heads, k_dim, v_dim, dtype=q.dtype, device=q.device)
             if initial_state is None else initial_state.float())
    k_to_end = k * (G[..., -1:] - G).exp().unsqueeze(-1)  # each step's write, decayed to the chunk's end
    chunk_decay = G[..., -1].exp()[..., None, None]
    q_start = q * G.exp().unsqueeze(-1)  # each step's read of the chunk's start state
    reads, news = [], []
    for q_n, u_n, w_n, k_n, d_n in zip(q_start.unbind(2), u.unbind(2), w.unbind(2), k_to_end.unbind(2),
                                       chunk_decay.unbind(2)):
        reads.append(q_n @ state)
        new = u_n - w_n @ state
        news.append(new)
        state = state * d_n + k_n.transpose(-1, -2) @ new
    out = torch.stack(reads, 2) + ((q @ k.transpose(-1, -2)) * decay) @ torch.stack(news, 2)
    out = out.reshape(batch, v_heads, -1, v_dim)[:, :, :length].transpose(1, 2).contiguous().to(dtype)
    return out, state if output_final_state else None
