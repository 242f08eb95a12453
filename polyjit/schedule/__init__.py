"""Affine program -> isl schedule -> isl AST.

Dependences come from isl's dataflow analysis; the isl scheduler fuses
producer and consumer loop nests (with shifts, as for two stencils), and a
few tree rewrites follow, each kept only if isl confirms that every
dependence still holds: the loop that walks contiguous memory goes innermost,
bands with reuse (contractions) are tiled, and the outermost coincident loop
of each nest is marked parallel. Temporary arrays whose values die within a
few iterations of the loop that makes them are contracted (to a scalar, a row,
a rolling window); isl checks every candidate storage map for overlapping
live ranges.

The modules, by concern: ``dependences`` (isl's context, dataflow,
legality), ``fusion`` (fusion groups and the cost models that refuse or undo
a fusion), ``rewrites`` (rewrites both targets use), ``cpu_rewrites`` and
``gpu_rewrites`` (each target's), ``contraction`` (temporaries' storage),
``ast`` (queries of isl's AST), ``groups`` (a group as a program of its own)
and ``driver`` (schedule_program). ``tree`` holds the helpers they share.
"""
from .ast import ast_nodes, statements_in
from .contraction import contract
from .cpu_rewrites import MIN_PARALLEL_EXTENT
from .dependences import dependences, is_legal, make_context
from .driver import schedule_program
from .fusion import FusionPlan, fusion_groups, fusion_refusal
from .groups import GroupProblem, ProgramSchedule, Scheduled, ScheduledGroup, group_problem
from .tree import is_product_init, is_update

__all__ = ["MIN_PARALLEL_EXTENT", "FusionPlan", "GroupProblem", "ProgramSchedule", "Scheduled", "ScheduledGroup",
           "ast_nodes", "contract", "dependences", "fusion_groups", "fusion_refusal", "group_problem",
           "is_legal", "is_product_init", "is_update", "make_context", "schedule_program", "statements_in"]
