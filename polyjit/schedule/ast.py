"""Queries of isl's AST: its top-level nests (one kernel each), its nodes,
the statements under a node."""
from __future__ import annotations

import islpy as isl

from .tree import isl_items


def kernel_nodes(ast: isl.AstNode) -> list[isl.AstNode]:
    if ast.get_type() == isl.ast_node_type.block:
        return isl_items(ast.block_get_children())
    return [ast]


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
    return {n.user_get_expr().get_op_arg(0).get_id().get_name()
            for n in ast_nodes(node) if n.get_type() == isl.ast_node_type.user}
