"""Attention as one op in AOTAutograd's trace.

``scaled_dot_product_attention`` reaches AOTAutograd as a composite: its
math variant (the one whose products and softmax fuse with their
neighbours) is traced op by op, a product through matmul's own Python
decomposition, and its backward op by op again. That trace costs more
than the rest of a transformer layer's. Before AOTAutograd, the
attentions of dynamo's graph that the math variant would compute
without dropout are replaced by ``polyjit::attention``, an op of two
results, the output and the softmax's probabilities, whose backward is
``polyjit::attention_backward``: the probabilities are saved for it, as
the math variant's trace saves them. Each is one node, which the ATen
table lowers to the same products and softmax.
"""
from __future__ import annotations

import numbers
import operator

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

Tensor = torch.Tensor


def _scale(query: Tensor, scale: float | None) -> float:
    """The scores' scale: by default 1/sqrt(head size), as torch's."""
    return query.size(-1) ** -0.5 if scale is None else scale


def _scores(query: Tensor, key: Tensor, mask: Tensor | None, causal: bool, scale: float | None) -> Tensor:
    """The scaled products of queries and keys, masked (in float32 for the half types)."""
    s = torch.matmul(query, key.transpose(-2, -1)).float() * _scale(query, scale)
    if causal:
        keep = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s + (torch.zeros_like(mask, dtype=s.dtype).masked_fill(~mask, float("-inf"))
                 if mask.dtype == torch.bool else mask.float())
    return s


@torch.library.custom_op("polyjit::attention", mutates_args=())
def attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, causal: bool,
              scale: float | None) -> tuple[Tensor, Tensor]:
    """softmax(query keyᵀ scale + mask) value, and the softmax; a row whose
    keys are all masked gives zeros (as the math variant's _safe_softmax)."""
    s = _scores(query, key, mask, causal, scale)
    p = torch.softmax(s, -1)
    p = torch.where(torch.amax(s, -1, keepdim=True) == float("-inf"), 0.0, p).to(query.dtype)
    return torch.matmul(p, value), p


@attention.register_fake
def _(query, key, value, mask, causal, scale):
    return (query.new_empty((*query.shape[:-1], value.shape[-1])),
            query.new_empty((*query.shape[:-1], key.shape[-2])))


@torch.library.custom_op("polyjit::attention_backward", mutates_args=())
def attention_backward(grad: Tensor, query: Tensor, key: Tensor, value: Tensor, probs: Tensor,
                       scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of attention's query, key and value, from its
    probabilities, each laid out as its input is (as the fake's): the
    graph after it may view them so, a head's split undone (a partition
    run by PyTorch, a fallback, runs this)."""
    scale = _scale(query, scale)
    dv = torch.matmul(probs.transpose(-2, -1), grad)
    dp = torch.matmul(grad, value.transpose(-2, -1)).float()
    p = probs.float()
    ds = (p * (dp - (dp * p).sum(-1, keepdim=True))).to(query.dtype)
    grads = torch.matmul(ds, key) * scale, torch.matmul(ds.transpose(-2, -1), query) * scale, dv
    return tuple(torch.empty_like(x).copy_(g) for x, g in zip((query, key, value), grads))


@attention_backward.register_fake
def _(grad, query, key, value, probs, scale):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, _, _, scale = inputs
    ctx.save_for_backward(query, key, value, output[1])
    ctx.scale = scale
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad, _):
    query, key, value, probs = ctx.saved_tensors
    return (*attention_backward(grad, query, key, value, probs, ctx.scale), None, None, None)


attention.register_autograd(_backward, setup_context=_setup_context)

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def fuse_attention(gm: torch.fx.GraphModule) -> int:
    """Replace dynamo's scaled_dot_product_attention calls that polyjit::attention
    computes alike (no dropout, no grouped heads, one dtype, a mask that
    needs no gradient); the number replaced."""
    replaced = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=torch._C._nn.scaled_dot_product_attention)):
        args = {**_SDPA_DEFAULTS, **dict(zip(_SDPA_ARGS, node.args)), **node.kwargs}
        if not _alike(node, args):
            continue
        scale = None if args["scale"] is None else float(args["scale"])
        with gm.graph.inserting_before(node):
            both = gm.graph.call_function(torch.ops.polyjit.attention.default,
                                          (args["query"], args["key"], args["value"], args["attn_mask"],
                                           args["is_causal"], scale))
            out = gm.graph.call_function(operator.getitem, (both, 0))
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.recompile()
    return replaced


def _alike(node: torch.fx.Node, args: dict) -> bool:
    """Whether polyjit::attention computes the attention node as its math variant does."""
    vals = {k: a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a for k, a in args.items()}
    q, k, v, mask, out = vals["query"], vals["key"], vals["value"], vals["attn_mask"], node.meta.get("example_value")
    if not all(isinstance(t, Tensor) for t in (q, k, v, out)) or not q.dtype.is_floating_point:
        return False
    if set(args) - set(_SDPA_ARGS) or vals["enable_gqa"] is not False or not isinstance(vals["is_causal"], bool):
        return False
    if not isinstance(vals["dropout_p"], numbers.Real) or vals["dropout_p"] != 0:
        return False
    if vals["scale"] is not None and not isinstance(vals["scale"], numbers.Real):
        return False
    if len({q.dtype, k.dtype, v.dtype, out.dtype}) != 1 or q.ndim < 2 or not q.ndim == k.ndim == v.ndim:
        return False  # (autocast casts the inputs: the node's dtype is not theirs)
    if mask is not None and (not isinstance(mask, Tensor) or mask.requires_grad or vals["is_causal"]
                             or mask.dtype not in (torch.bool, q.dtype)):
        return False
    same = [*zip(q.shape[:-2], k.shape[:-2]), *zip(k.shape[:-2], v.shape[:-2]), (q.shape[-1], k.shape[-1]),
            (k.shape[-2], v.shape[-2])]
    return all(statically_known_true(a == b) for a, b in same)
