"""Queries of isl's AST: its top-level nests (one kernel each), its nodes,
the statements under a node, loops' static extents, the iterators an
expression reads."""
from __future__ import annotations

import islpy as isl

from .tree import IN_ORDER, SIDE_BY_SIDE, isl_items


def kernel_nodes(ast: isl.AstNode) -> list[isl.AstNode]:
    """The top-level nests of an AST, one kernel each."""
    if ast.get_type() == isl.ast_node_type.block:
        return isl_items(ast.block_get_children())
    return [ast]


def in_order_kernel(node: isl.AstNode) -> bool:
    """Whether a kernel's nest is a target's preparation (tree.in_order): its
    nests depend on one another, so one thread runs them, in order."""
    return node.get_type() == isl.ast_node_type.mark and node.mark_get_id().get_name() == IN_ORDER


def side_by_side_kernel(node: isl.AstNode) -> bool:
    """Whether a kernel's nest is a target's independent first statements
    (tree.side_by_side): a nest each, its threads dealt out among them."""
    return node.get_type() == isl.ast_node_type.mark and node.mark_get_id().get_name() == SIDE_BY_SIDE


def ast_nodes(node: isl.AstNode) -> list[isl.AstNode]:
    """node and every node under it, top down (walked in Python: isl's
    foreach callbacks swallow exceptions, see isl_items)."""
    out = [node]
    t = node.get_type()
    if t == isl.ast_node_type.block:
        for kid in isl_items(node.block_get_children()):
            out += ast_nodes(kid)
    elif t == isl.ast_node_type.for_:
        out += ast_nodes(node.for_get_body())
    elif t == isl.ast_node_type.if_:
        out += ast_nodes(node.if_get_then_node())
        if node.if_has_else_node():
            out += ast_nodes(node.if_get_else_node())
    elif t == isl.ast_node_type.mark:
        out += ast_nodes(node.mark_get_node())
    return out


def statements_in(node: isl.AstNode) -> set[str]:
    """The statements called under node."""
    return {n.user_get_expr().get_op_arg(0).get_id().get_name()
            for n in ast_nodes(node) if n.get_type() == isl.ast_node_type.user}


def static_extent(loop: isl.AstNode) -> int | None:
    """The trip count of a unit-step loop whose bounds are numbers."""
    if loop.for_get_init().get_type() != isl.ast_expr_type.int \
            or loop.for_get_cond().get_op_arg(1).get_type() != isl.ast_expr_type.int:
        return None
    return fixed_extent(loop)


def ast_children(n: isl.AstNode) -> list[isl.AstNode] | None:
    """The loops, statements and branches of n, blocks flattened (None for other nodes)."""
    if n.get_type() == isl.ast_node_type.block:
        lst = n.block_get_children()
        out = []
        for i in range(lst.n_ast_node()):
            kids = ast_children(lst.get_at(i))
            if kids is None:
                return None
            out += kids
        return out
    if n.get_type() in (isl.ast_node_type.for_, isl.ast_node_type.user, isl.ast_node_type.if_):
        return [n]
    return None


def ast_calls(n: isl.AstNode) -> list[isl.AstExpr] | None:
    """The statement calls of a straight-line body (None where it has loops or branches)."""
    kids = ast_children(n)
    if kids is None or any(k.get_type() != isl.ast_node_type.user for k in kids):
        return None
    return [k.user_get_expr() for k in kids]


def ast_uses(e: isl.AstExpr, names: set[str]) -> bool:
    """Whether an isl AST expression reads any of the iterators in names."""
    if not names:
        return False
    t = e.get_type()
    if t == isl.ast_expr_type.id:
        return e.get_id().get_name() in names
    if t == isl.ast_expr_type.op:
        return any(ast_uses(e.get_op_arg(i), names) for i in range(e.get_op_n_arg()))
    return False


def unit_step(e: isl.AstExpr, it: str) -> bool:
    """Whether e is iterator it plus or minus terms without it (e moves by one as it does)."""
    if e.get_type() == isl.ast_expr_type.id:
        return e.get_id().get_name() == it
    add = isl.ast_expr_op_type.add
    if e.get_type() != isl.ast_expr_type.op or e.get_op_type() not in (add, isl.ast_expr_op_type.sub):
        return False
    a, b = e.get_op_arg(0), e.get_op_arg(1)
    return (unit_step(a, it) and not ast_uses(b, {it})) or \
        (e.get_op_type() == add and unit_step(b, it) and not ast_uses(a, {it}))


def ast_affine(e: isl.AstExpr) -> dict[str, int] | None:
    """e as coefficients by iterator or parameter name ("" for the
    constant), or None where e is no sum of multiples of names."""
    t = e.get_type()
    if t == isl.ast_expr_type.int:
        return {"": e.get_val().to_python()}
    if t == isl.ast_expr_type.id:
        return {e.get_id().get_name(): 1}
    T = isl.ast_expr_op_type
    op = e.get_op_type()
    args = [ast_affine(e.get_op_arg(i)) for i in range(e.get_op_n_arg())]
    if any(a is None for a in args):
        return None
    if op == T.minus:
        return {k: -v for k, v in args[0].items()}
    if op in (T.add, T.sub):
        out = dict(args[0])
        for k, v in args[1].items():
            out[k] = out.get(k, 0) + (v if op == T.add else -v)
        return out
    if op == T.mul:
        a, b = args
        if set(a) == {""}:
            a, b = b, a
        if set(b) != {""}:
            return None
        return {k: v * b[""] for k, v in a.items()}
    return None


def fixed_extent(loop: isl.AstNode) -> int | None:
    """The trip count of a unit-step loop whose bounds differ by a number
    (``for c = 64 * t; c <= 64 * t + 63``), else None."""
    inc, cond = loop.for_get_inc(), loop.for_get_cond()
    if inc.get_type() != isl.ast_expr_type.int or inc.get_val().to_python() != 1 \
            or cond.get_op_type() not in (isl.ast_expr_op_type.le, isl.ast_expr_op_type.lt):
        return None
    lo, hi = ast_affine(loop.for_get_init()), ast_affine(cond.get_op_arg(1))
    if lo is None or hi is None:
        return None
    diff = {k: hi.get(k, 0) - lo.get(k, 0) for k in set(lo) | set(hi)}
    if any(v for k, v in diff.items() if k):
        return None
    return max(diff.get("", 0) + (cond.get_op_type() == isl.ast_expr_op_type.le), 0)
