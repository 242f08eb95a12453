"""An IRBuilder that folds integer arithmetic on constants and reuses
integer instructions already in the block as it emits.

Index arithmetic is emitted per access from the AST and the arrays' shapes:
strides that are products of constant sizes, unrolled taps whose padding
tests compare constants, `x * 1` and `x + 0`, and each tap's address
recomputing the terms of the others (`c1 * 196`). llvmlite writes every one
of these as an instruction, which Python then builds and prints and LLVM
parses and folds away: a depthwise convolution's kernel was mostly such
instructions. Folding and reusing them here gives LLVM the same program,
smaller.
"""
from __future__ import annotations

from llvmlite import ir

_SIGNED = {"==": int.__eq__, "!=": int.__ne__, "<": int.__lt__, "<=": int.__le__, ">": int.__gt__,
           ">=": int.__ge__}


def _int(v) -> int | None:
    """v's value where it is an integer constant, else None."""
    if isinstance(v, ir.Constant) and isinstance(v.type, ir.IntType) and isinstance(v.constant, int):
        return v.constant
    return None


def power_of_two(y) -> int | None:
    """k where y is the integer constant 2**k (k >= 1), else None: a floored
    division by it is an arithmetic shift, a floored remainder a mask."""
    v = _int(y)
    return v.bit_length() - 1 if v is not None and v > 1 and v & (v - 1) == 0 else None


def _wrapped(value: int, typ: ir.IntType) -> ir.Constant:
    """value as a constant of typ, wrapped to its width and read as signed."""
    bits = typ.width
    value &= (1 << bits) - 1
    if bits > 1 and value >= 1 << (bits - 1):
        value -= 1 << bits
    return ir.Constant(typ, value)


def _truncated(a: int, b: int) -> int | None:
    """a / b rounded toward zero, as sdiv computes it; None for b = 0."""
    if not b:
        return None
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def _folded(op: str, compute, left: int | None = None, right: int | None = None):
    """The builder method op: compute(a, b) where both operands are integer
    constants, the other operand where one is the identity (left, right),
    else the instruction (reused where the block has it)."""
    def method(self, lhs, rhs, name="", flags=()):
        if flags:
            return getattr(ir.IRBuilder, op)(self, lhs, rhs, name, flags)
        a, b = _int(lhs), _int(rhs)
        value = compute(a, b) if a is not None and b is not None else None
        if value is not None:
            return _wrapped(value, lhs.type)
        if left is not None and a == left:
            return rhs
        if right is not None and b == right:
            return lhs
        return self._int_op(op, lhs, rhs, flags)
    method.__name__ = op
    return method


def _slot(ptr) -> bool:
    """Whether ptr is a slot: an alloca of one value (an iterator's, a
    running sum's), which only this builder's loads and stores reach."""
    return isinstance(ptr, ir.AllocaInstr) and not ptr.operands


def _operand(v):
    return ("const", str(v.type), v.constant) if isinstance(v, ir.Constant) else id(v)


class FoldingBuilder(ir.IRBuilder):
    """ir.IRBuilder with add, sub, mul, sdiv, and, or, signed compares and
    select folded where their operands make the result known, and integer
    instructions (no flags) and slots' loads reused where the same one is
    already in the block the builder appends to (it dominates what follows);
    a slot's load after a store to it in the block is the stored value."""

    def __init__(self, block=None) -> None:
        super().__init__(block)
        self._known: dict = {}  # id(block) -> {(op, operands): instruction; ("slot", id): value}

    def _reused(self, key, make):
        """What make() gives, or what this block already holds under key: the
        same instruction, or the value last stored to a slot (a constant or
        an instruction of another block, too)."""
        block = self._block
        if block is None or self._anchor != len(block.instructions):
            return make()
        known = self._known.setdefault(id(block), {})
        v = known.get(key)
        if v is None:
            v = known[key] = make()
        return v

    def _int_op(self, name: str, lhs, rhs, flags):
        op = getattr(super(), name)
        if flags or not isinstance(lhs.type, ir.IntType):
            return op(lhs, rhs, "", flags)
        return self._reused((name, _operand(lhs), _operand(rhs)), lambda: op(lhs, rhs, "", flags))

    add = _folded("add", lambda a, b: a + b, left=0, right=0)
    sub = _folded("sub", lambda a, b: a - b, right=0)
    mul = _folded("mul", lambda a, b: a * b, left=1, right=1)
    sdiv = _folded("sdiv", _truncated, right=1)
    and_ = _folded("and_", lambda a, b: a & b)
    or_ = _folded("or_", lambda a, b: a | b)

    def icmp_signed(self, cmpop, lhs, rhs, name=""):
        a, b = _int(lhs), _int(rhs)
        if a is not None and b is not None and lhs.type.width > 1:
            return ir.Constant(ir.IntType(1), int(_SIGNED[cmpop](a, b)))
        return self._reused(("icmp", cmpop, _operand(lhs), _operand(rhs)),
                            lambda: super(FoldingBuilder, self).icmp_signed(cmpop, lhs, rhs, name))

    def select(self, cond, lhs, rhs, name="", flags=()):
        c = _int(cond)
        if c is not None and not flags:
            return lhs if c else rhs
        if flags or not isinstance(lhs.type, ir.IntType):
            return super().select(cond, lhs, rhs, name, flags)
        return self._reused(("select", _operand(cond), _operand(lhs), _operand(rhs)),
                            lambda: super(FoldingBuilder, self).select(cond, lhs, rhs, name, flags))

    def load(self, ptr, name="", align=None, typ=None):
        """A slot's load reused where this block already loaded the slot, or
        the value the block last stored to it: each statement's indices
        reloaded every iterator, and the arithmetic on the loads then
        differed too."""
        def made():
            return super(FoldingBuilder, self).load(ptr, name, align, typ)
        if not _slot(ptr):
            return made()
        v = self._reused(("slot", id(ptr)), made)
        return v if v.type == (typ or ptr.allocated_type) else made()  # (read at another type: from memory)

    def store(self, value, ptr, align=None):
        """The store; to a slot, appended at the block's end, its value is
        what the block's later loads of the slot give. One put before the
        end drops what the block knew of the slot: loads read memory again."""
        block = self._block
        if _slot(ptr) and block is not None:
            known = self._known.setdefault(id(block), {})
            if self._anchor == len(block.instructions):
                known[("slot", id(ptr))] = value
            else:
                known.pop(("slot", id(ptr)), None)
        return super().store(value, ptr, align)

    def srem(self, lhs, rhs, name="", flags=()):
        return self._int_op("srem", lhs, rhs, flags)

    def ashr(self, lhs, rhs, name="", flags=()):
        return self._int_op("ashr", lhs, rhs, flags)

    def zext(self, value, typ, name=""):
        return self._reused(("zext", _operand(value), str(typ)),
                            lambda: super(FoldingBuilder, self).zext(value, typ, name))
