"""Array contraction: temporaries whose values die within a few iterations
of the loop that makes them keep only a window (a scalar, a row, a rolling
buffer); isl checks every candidate storage map for overlapping live ranges."""
from __future__ import annotations

import islpy as isl

from .. import sizes as sz
from ..affine import AffineProgram


MAX_MODULUS = 8


def _slot_map(ctx, prog: AffineProgram, name: str, moduli) -> isl.Map:
    rank = len(prog.arrays[name].shape)
    i = [f"i{d}" for d in range(rank)]
    o = [f"o{d}" for d in range(rank)]
    cons = []
    for d, m in enumerate(moduli):
        if m is None:
            cons.append(f"o{d} = i{d}")
        elif m > 1:
            cons.append(f"(o{d} - i{d}) mod {m} = 0")
    diff = " or ".join(f"o{d} > i{d} or o{d} < i{d}" for d in range(rank)) or "1 = 0"
    cons.append(f"({diff})")
    text = prog.prefix() + f"{{ {name}[{', '.join(i)}] -> {name}[{', '.join(o)}] : {' and '.join(cons)} }}"
    return isl.Map.read_from_str(ctx, text)


def _live_conflict(ctx, prog, name, moduli, tw: isl.Map, between: isl.Map) -> bool:
    same = _slot_map(ctx, prog, name, moduli)
    return not same.apply_range(tw).intersect(between).is_empty()


def contract(ctx, prog: AffineProgram, schedule: isl.Schedule, dom, kernels, shared=frozenset(), access=None) -> dict:
    """Moduli of the temporaries (not in shared: used by other groups too)
    that one kernel keeps to itself, along dimensions where a window suffices
    (access: dependences.accesses(ctx, prog, dom), where already known)."""
    smap = schedule.get_map().intersect_domain(dom)
    if access is None:
        from .dependences import accesses
        access = accesses(ctx, prog, dom)
    _, may, reads = access
    where: dict[str, set[int]] = {}
    for k, names in enumerate(kernels):
        for s in prog.statements:
            if s.name in names:
                where.setdefault(s.array, set()).add(k)
                for ld in prog.statement_loads(s):
                    where.setdefault(ld.array, set()).add(k)
    out = {}
    called = {box[0] for s in prog.statements if s.library is not None  # a library call's operands stay whole
              for box in [s.library.written()] + s.library.read()}
    for name, arr in prog.arrays.items():
        if arr.kind != "temp" or name in shared or len(where.get(name, ())) != 1 or not arr.shape or name in called:
            continue
        space = isl.Set.read_from_str(ctx, prog.prefix() + f"{{ {name}[{', '.join(f'x{d}' for d in range(len(arr.shape)))}] }}").get_space()
        tw_u = may.intersect_range(isl.UnionSet.from_set(isl.Set.universe(space))).reverse().apply_range(smap)
        tr_u = reads.intersect_range(isl.UnionSet.from_set(isl.Set.universe(space))).reverse().apply_range(smap)
        if tw_u.is_empty() or tr_u.is_empty():
            continue
        tw, tr = isl.Map.from_union_map(tw_u), isl.Map.from_union_map(tr_u)
        lt = isl.Map.lex_lt(tw.get_space().range())
        between = tw.lexmin().apply_range(lt).intersect(tr.lexmax().apply_range(lt.reverse()))
        moduli: list[int | None] = [None] * len(arr.shape)
        for d, extent in enumerate(arr.shape):
            limit = MAX_MODULUS if not sz.is_static(extent) else min(MAX_MODULUS, int(extent) - 1)
            if limit < 1 or _live_conflict(ctx, prog, name, moduli[:d] + [limit] + moduli[d + 1:], tw, between):
                continue  # (a contiguous window wider than the largest modulus; left whole is always safe)
            for m in range(1, limit + 1):
                trial = moduli[:d] + [m] + moduli[d + 1:]
                if m == limit or not _live_conflict(ctx, prog, name, trial, tw, between):
                    moduli = trial
                    break
        if any(m is not None for m in moduli):
            out[name] = tuple(moduli)
    return out


def private_bytes(arr, moduli) -> float:
    """The bytes arr takes, contracted to moduli (inf where a size is symbolic)."""
    count = 1
    for s, m in zip(arr.shape, moduli):
        if m is None and not sz.is_static(s):
            return float("inf")
        count *= int(s) if m is None else m
    return count * arr.dtype.itemsize
