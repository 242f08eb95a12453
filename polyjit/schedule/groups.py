"""Fusion groups as programs of their own (canonical names, so that groups
of the same structure share one schedule), their schedules, and the whole
program's view of them."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from typing import Callable

import islpy as isl

from ..affine import AffineProgram
from ..expr import Load, substitute
from .ast import kernel_nodes, statements_in
from .dependences import make_context


class Scheduled:
    """A group's schedule and AST, and what they decided. A group a worker
    process scheduled (and made the code of, codegen.program.WorkerCodes)
    comes with isl's objects as text: the schedule is read again and the AST
    built again only where asked for (its code made anew), the texts
    serving the program's printed stages meanwhile."""

    def __init__(self, schedule: isl.Schedule | None, ast: isl.AstNode | None,
                 contracted: dict[str, tuple[int | None, ...]] | None = None,
                 kernels: list[set[str]] | None = None, kernel_of_array: dict[str, int] | None = None,
                 refused: list[str] | None = None, texts: tuple[str, str, str] | None = None,
                 build_ast: Callable[[isl.Schedule], isl.AstNode] | None = None) -> None:
        self._schedule, self._ast = schedule, ast
        self.contracted = contracted or {}
        self.kernels = kernels or []  # statement names per top-level nest
        self.kernel_of_array = kernel_of_array or {}
        self.refused = refused or []  # fusions the cost model refused, with why
        self._texts = texts  # (isl's schedule, its tree as printed, the AST in C), where the objects are not built
        self._build_ast = build_ast

    @property
    def schedule(self) -> isl.Schedule:
        if self._schedule is None:
            self._schedule = isl.Schedule.read_from_str(make_context(), self._texts[0])
        return self._schedule

    @property
    def ast(self) -> isl.AstNode:
        if self._ast is None:
            ast = self._build_ast(self.schedule)
            check_worker_ast(ast, self.kernels)
            self._ast = ast
        return self._ast

    def schedule_tree(self) -> str:
        return str(self._schedule.get_root()) if self._texts is None else self._texts[1]

    def ast_text(self) -> str:
        return self._ast.to_C_str() if self._texts is None else self._texts[2]

    def kernel_asts(self) -> list[isl.AstNode]:
        """The top-level nests, one kernel each."""
        return kernel_nodes(self.ast)


class WorkerAstMismatch(RuntimeError):
    """A group's AST built again from a worker's schedule has kernels unlike the worker's."""


def check_worker_ast(ast: isl.AstNode, kernels: list[set[str]]) -> None:
    """WorkerAstMismatch unless ast (built again here from a worker's
    schedule) has the worker's kernels: never code unlike the worker's."""
    if [statements_in(k) for k in kernel_nodes(ast)] != kernels:
        raise WorkerAstMismatch("a group's AST built again differs from its worker's")


@dataclass
class GroupProblem:
    """A fusion group as a program of its own, in names of its own."""

    prog: AffineProgram
    statements: dict[str, str]  # a statement's name in prog -> in the whole program
    arrays: dict[str, str]  # likewise for arrays
    shared: frozenset[str]  # arrays (named as in prog) that other groups use too
    key: str  # everything the group's schedule and code depend on
    structure: str  # the same with every number left out (sizes, offsets, constants), names kept
    in_order: bool = False  # the target's preparation: its statements in order, one kernel (tree.in_order)
    side_by_side: bool = False  # the target's independent first statements: one kernel, threads for each

    @property
    def nests_apart(self) -> bool:
        """Each statement in a nest of its own (in order, side by side): each
        temporary is written by one nest and read by later ones or by other
        groups, so the schedule needs no dependences and none is contracted."""
        return self.in_order or self.side_by_side


_CANONICAL = re.compile(r"\b_[sa]\d+\b")
_NUMBERS = re.compile(r"(?<!\w)\d+")


def group_problem(prog: AffineProgram, group: list[str], shared: set[str], canonical: bool = True,
                  in_order: bool = False, side_by_side: bool = False) -> GroupProblem:
    """The statements of group (and the arrays they touch), renamed _s0, _s1,
    ... and _a0, _a1, ... in order of appearance where canonical; in_order:
    the group is the target's preparation (GroupProblem.in_order); side_by_side:
    its independent first statements (GroupProblem.side_by_side)."""
    arrays: dict[str, str] = {}

    def array(name: str) -> str:
        return arrays.setdefault(name, f"_a{len(arrays)}" if canonical else name)

    def rename(e):
        if isinstance(e, Load):
            return Load(e.dtype, array(e.array), tuple(substitute(i, rename) for i in e.index))
        return None
    stmts, names = [], {}
    for s in prog.statements:
        if s.name in group:
            name = f"_s{len(stmts)}" if canonical else s.name
            names[name] = s.name
            stmts.append(replace(s, name=name, array=array(s.array), index=tuple(substitute(i, rename) for i in s.index),
                                 body=substitute(s.body, rename),
                                 library=s.library and s.library.renamed(array)))
    arrs = {new: replace(prog.arrays[old], name=new, index=k if canonical else prog.arrays[old].index)
            for k, (old, new) in enumerate(arrays.items())}
    mine = frozenset(new for old, new in arrays.items() if old in shared)
    sub = AffineProgram(list(prog.params), arrs, stmts, [])
    key = "\n".join([repr(prog.params), *map(repr, arrs.values()), *map(repr, stmts), repr(sorted(mine)),
                     "in order" if in_order else "side by side" if side_by_side else ""])
    return GroupProblem(sub, names, {new: old for old, new in arrays.items()}, mine,
                        hashlib.sha256(key.encode()).hexdigest(),
                        hashlib.sha256(_NUMBERS.sub("#", key).encode()).hexdigest(), in_order, side_by_side)


@dataclass
class ScheduledGroup:
    problem: GroupProblem
    sched: Scheduled

    def real_names(self, text: str) -> str:
        """text with the group's names replaced by the program's."""
        p = self.problem
        return _CANONICAL.sub(lambda m: p.statements.get(m.group(0)) or p.arrays.get(m.group(0), m.group(0)), text)


class ProgramSchedule:
    """The groups' schedules, and what they say about the whole program, in
    its names: the statements of each kernel, contracted temporaries, the
    first kernel writing each array."""

    def __init__(self, prog: AffineProgram, groups: list[ScheduledGroup], refused: list[str] = ()) -> None:
        self.groups = groups
        self.kernels: list[set[str]] = []
        self.contracted: dict[str, tuple[int | None, ...]] = {}
        self.kernel_of_array: dict[str, int] = {}
        self.refused = list(refused) + [g.real_names(why) for g in groups for why in g.sched.refused]
        for g in groups:
            p = g.problem
            for a, k in kernel_of_each_array(p.prog, g.sched.kernels, len(self.kernels), p.arrays).items():
                self.kernel_of_array.setdefault(a, k)
            self.kernels += [{p.statements[n] for n in k} for k in g.sched.kernels]
            self.contracted.update({p.arrays[a]: m for a, m in g.sched.contracted.items()})

    def kernel_asts(self) -> list[isl.AstNode]:
        return [node for g in self.groups for node in g.sched.kernel_asts()]

    def ast_text(self) -> str:
        return "\n".join(g.real_names(g.sched.ast_text()).rstrip("\n") for g in self.groups) + "\n"

    def schedule_text(self) -> str:
        return "\n".join(g.real_names(g.sched.schedule_tree()) for g in self.groups)


def kernel_of_each_array(prog: AffineProgram, kernels: list[set[str]], offset: int = 0,
                         names: dict[str, str] | None = None) -> dict[str, int]:
    """The first kernel writing each array (names: the statements' and
    arrays' names in prog, where the kernels use others)."""
    out: dict[str, int] = {}
    for k, stmts in enumerate(kernels):
        for s in prog.statements:
            if s.name in stmts:
                out.setdefault(names[s.array] if names else s.array, k + offset)
    return out
