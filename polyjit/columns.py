"""Generated convolutions as products along flattened image positions, for
targets whose register blocks run along a contraction's columns (the CPU).

A channels-first convolution computed in place blocks its columns along an
image row: a 7x7 image gives seven of a vector's sixteen lanes work, and the
padding guards sit inside the reduction. As a product per image and group,
Y (out channels x positions) = W (out channels x reduction) @ X (reduction x
positions), its positions run along every row of the image and the
scheduler's register blocks fill their vectors (cpu_rewrites.block_shape),
as they do for a matrix product. X is one of:

- shifted (stride 1): the input, padded, its rows laid end to end; the tap
  (kh, kw) of output position q is the padded image at q + kh Wp + kw
  (Wp: the padded width), so X is the padded copy read at a shift per tap
  and the product computes Wp - OW extra positions per output row, kept
  in its array, whose rows are Wp wide (consumers read their first OW; an
  output handed to the caller is copied from it into rows of its own);
- columns (im2col): each tap's input, a copy of (reduction dims...,
  positions), the input read once per tap.

Either copy is a statement of its own (role TAPS), so a producer (a batch
norm and relu) is computed into it, where the input was not an array. The
product writes its result at the position unflattened (p // W, p % W),
which its consumers read plainly (isl's scheduler, given flattened reads
instead, took 19 s over one of MobileNetV3's groups); the store's address
is the position again (expr.merged_index).
"""
from __future__ import annotations

import math

from . import expr as E
from .affine import TAPS, Role, loop_nest
from .expr import Load, Op
from .library import FORM, _conv_reduction, _packed_kernel, conv_taps, filter_taps, gemm_form, in_place_taps

MAX_SHIFTED_WASTE = 0.15  # the extra positions a shifted product may compute, as a share of its own
MIN_IMAGE = 2048  # outputs an image from which a product is made however short its reduction (inline, a
# 16-channel pointwise convolution shared a group with a depthwise stencil); smaller ones (a squeeze-excite's
# 1x1 images) unroll inline where their reduction is short


def columns_form(L, n) -> tuple[tuple, tuple] | None:
    """How convolution n, generated, runs as a product along its positions:
    (the shape its result is stored in: its own, or with rows Wp wide in
    the shifted form; the sizes its positions are numbered over), or None
    where no form applies (not channels first in float32 with static kernel
    and image sizes; a reduction too short to block, a depthwise or
    few-channel convolution, stays a stencil; a small one unrolls inline).
    A result handed to the caller in the shifted form (a training forward's
    saved activation) is copied into rows of its own (lowering): a pass
    over the result, where the im2col copy is one over every tap. A weight
    gradient (gemm_form "cfirst") runs along the kernel's dims after its
    output channels."""
    if FORM.get(n.op) is not gemm_form or L.library is None or not L.library.target.column_convolutions:
        return None
    form, shape = gemm_form(L, n), tuple(L.shape(n))
    if form == "cfirst":
        return shape, tuple(int(s) for s in shape[1:])
    if form != "nchw" or _conv_reduction(n, L.shape(n.inputs[0]), L.shape(n.inputs[1]))[1]:
        return None
    if math.prod(int(s) for s in shape[1:]) < MIN_IMAGE and not L.is_statement_op(n):
        return None
    rows = [int(s) for s in shape[2:]]
    wide = _padded_width(L, n)
    if wide is not None and wide - rows[-1] <= MAX_SHIFTED_WASTE * rows[-1]:
        rows[-1] = wide
    return (*shape[:-1], rows[-1]), tuple(rows)


def shifted(L, n, rows) -> bool:
    """Whether the product n (columns_form: its positions over rows) reads
    its input padded and shifted, each element once (a producer is computed
    into the padded copy), rather than once per tap (im2col)."""
    return tuple(rows) != tuple(int(s) for s in L.shape(n)[2:])


def _padded_width(L, n) -> int | None:
    """The padded input's width, where n can read it shifted: an image (two
    spatial dims), stride 1, no negative padding."""
    at, lay = n.attrs, n.attrs["layout"]
    sp = [c for c in lay if c not in "NC"]
    if len(sp) != 2 or any(s != 1 for s in at["strides"]) or any(lo < 0 or hi < 0 for lo, hi in at["padding"]):
        return None
    lo, hi = at["padding"][-1]
    return int(L.shape(n.inputs[0])[lay.index(sp[-1])]) + lo + hi


def lower_columns(L, n, out: str, rows: tuple[int, ...]) -> None:
    """n (columns_form: its positions numbered over rows) as its taps' copy
    and the product's initialization and update over (image, [group,] out
    channel, position)."""
    from .lowering import reshape_index
    if gemm_form(L, n) == "cfirst":
        return _filter(L, n, out, rows)
    klay, groups = n.attrs["kernel_layout"], n.attrs["groups"]
    ws = L.shape(n.inputs[1])
    kdims = [c for c in klay if c != "O"]  # the reduction in the kernel's memory order
    cout_g = int(ws[klay.index("O")]) // groups
    grouped = (groups,) if groups > 1 else ()
    taps = (_shifted if shifted(L, n, rows) else _columns)(L, n, kdims, grouped)

    iters, idx, bounds = loop_nest((L.shape(n)[0], *grouped, cout_g, math.prod(rows)))
    riters, ridx, rbounds = loop_nest([ws[klay.index(c)] for c in kdims], "r")
    image, channel, p = idx[0], idx[-2], idx[-1]
    if groups > 1:
        channel = E.iadd(E.imul(idx[1], cout_g), channel)
    product = Op(n.dtype, "mul", (_weight(L, n, kdims, channel, ridx),
                                  taps(image, idx[1] if groups > 1 else None, dict(zip(kdims, ridx)), p)))
    _add_product(L, n, out, (iters, bounds, (image, channel, *reshape_index(rows, (math.prod(rows),), (p,)))),
                 (riters, rbounds), product)


def _filter(L, n, out: str, rest) -> None:
    """A weight gradient (gemm_form "cfirst": its output channels first, the
    images and positions its reduction) as a product along its other dims
    flattened (in channels, window): C (out channels x rest) = G (out
    channels x reduction) @ T (reduction x rest), G the gradient it reads as
    its kernel, T the input's taps, stored with rest innermost so that T's
    rows run along C's. Where T's copy would be the larger pass, the product
    runs along the out channels instead (_filter_across)."""
    from .lowering import reshape_index
    klay = n.attrs["kernel_layout"]
    kdims = [c for c in klay if c != "O"]
    kext = [int(L.shape(n.inputs[1])[klay.index(c)]) for c in kdims]
    cout, red, wide = int(L.shape(n)[0]), math.prod(kext), math.prod(rest)
    if cout % ACROSS_LANES == 0 and red * wide > ACROSS_GAIN * (red * cout + cout * wide):
        return _filter_across(L, n, out, rest, kdims, kext)
    name, _ = filter_taps(L, n, rest_first=False)
    iters, idx, bounds = loop_nest((L.shape(n)[0], math.prod(rest)))
    riters, ridx, rbounds = loop_nest(kext, "r")
    grad = _weight(L, n, kdims, idx[0], ridx)  # a row block's rows, read along the reduction
    _add_product(L, n, out, (iters, bounds, (idx[0], *reshape_index(rest, (math.prod(rest),), (idx[1],)))),
                 (riters, rbounds), Op(n.dtype, "mul", (grad, Load(n.dtype, name, (*ridx, idx[1])))))


ACROSS_LANES = 16  # a weight gradient runs along its out channels only in whole vectors of them
ACROSS_GAIN = 2  # ... and where the taps' copy is this many times the passes that form adds


def _filter_across(L, n, out: str, rest, kdims: list[str], kext: list[int]) -> None:
    """A weight gradient as a product along its out channels: C^T (rest x
    out channels) = T (rest x reduction) @ G^T (reduction x out channels).
    T's rows are the input read in place at each tap (a padded copy, the
    input's producer computed into it: a row's element is a broadcast, at
    any stride), G^T the gradient copied with its channels innermost, and
    C^T copied into the result's layout. Three passes over the input, the
    gradient and the result, where T's copy is one over every tap: 64
    channels at 28x28, its copy 24 times the result."""
    from .lowering import _linear, guarded, reshape_index
    x, g = n.inputs
    at, lay, klay = n.attrs, n.attrs["layout"], n.attrs["kernel_layout"]
    sp = [c for c in lay if c not in "NC"]
    xs = L.shape(x)
    padded = [int(xs[lay.index(c)]) + lo + hi for c, (lo, hi) in zip(sp, at["padding"])]
    pad_shape = tuple(padded[sp.index(c)] if c in sp else xs[d] for d, c in enumerate(lay))
    pad = f"t{n.id}_pad"
    L.declare_array(pad, pad_shape, n.dtype)
    iters, idx, bounds = loop_nest(pad_shape)
    xi = [E.isub(i, E.const(at["padding"][sp.index(c)][0])) if c in sp else i for i, c in zip(idx, lay)]
    L.add(pad, iters, bounds, idx, guarded(L, x, xi, E.const(0.0, n.dtype), [lay.index(c) for c in sp]), "pad",
          role=TAPS)
    cout = int(L.shape(n)[0])
    iters, idx, bounds = loop_nest((*kext, cout))
    value = _weight(L, n, kdims, idx[-1], idx[:-1])
    if isinstance(value, Load) and value.index == tuple(idx):  # (channels last already: NHWC's gradient)
        grad = value.array
    else:
        grad = f"t{n.id}_gT"
        L.declare_array(grad, (*kext, cout), n.dtype)
        L.add(grad, iters, bounds, idx, value, "pack")
    wide = math.prod(rest)
    across = f"t{n.id}_across"
    L.declare_array(across, (wide, cout), n.dtype)
    iters, idx, bounds = loop_nest((wide, cout))
    riters, ridx, rbounds = loop_nest(kext, "r")
    outs, kv = reshape_index(rest, (wide,), (idx[0],)), dict(zip(kdims, ridx))
    ov = dict(zip(lay[1:], outs))
    tap = [None] * len(lay)
    tap[lay.index("N")], tap[lay.index("C")] = ov["N"], kv["I"]
    dilation = at.get("dilation") or [1] * len(sp)
    for k, c in enumerate(sp):  # (conv_input_index's, in the padded copy)
        tap[lay.index(c)] = E.iadd(E.imul(ov[c], at["strides"][k]), E.imul(kv[c], dilation[k]))
    product = Op(n.dtype, "mul", (Load(n.dtype, pad, tuple(tap)), Load(n.dtype, grad, (*ridx, idx[1]))))
    _add_product(L, n, across, (iters, bounds, (idx[0], idx[1])), (riters, rbounds), product)
    iters, idx, bounds = loop_nest(L.shape(n))
    L.add(out, iters, bounds, idx, Load(n.dtype, across, (_linear(rest, idx[1:]), idx[0])), "copy")


def _add_product(L, n, out: str, result, reduction, product) -> None:
    """The product's initialization and update: result (iterators, bounds,
    the output's index they write), reduction (iterators, bounds)."""
    from .lowering import identity
    (iters, bounds, index), (riters, rbounds) = result, reduction
    L.add(out, iters, bounds, index, identity("sum", n.dtype), "conv_init", role=Role.INIT, contraction=True)
    L.add(out, iters + riters, bounds + rbounds, index, product, "conv", combine="sum", reduction_iters=riters,
          role=Role.UPDATE, contraction=True)


def _weight(L, n, kdims: list[str], channel, red):
    """The kernel at (out channel, reduction): read in place where it is an
    array or a view of one (a convolution's input gradient reads its kernel
    flipped, channels exchanged: a copy laid out for the rows cost more
    than it saved, the kernel coming from memory), else from a copy laid
    out (out channels, reduction dims), so that a kernel computed inline is
    computed once, not at every product."""
    w, klay = n.inputs[1], n.attrs["kernel_layout"]
    wi = [None] * w.rank
    wi[klay.index("O")] = channel
    for c, r in zip(kdims, red):
        wi[klay.index(c)] = r
    value = L.value(w, wi)
    if isinstance(value, Load):  # an array, or a view of one (flipped, transposed)
        return value
    name = f"t{n.id}_w"
    if name not in L.arrays:
        _packed_kernel(L, n, "O" + "".join(kdims))
    return Load(n.dtype, name, (channel, *red))


def _columns(L, n, kdims, grouped):
    """The product's tap: a load of the im2col copy (images, [groups,]
    reduction dims..., positions), or of the input itself (a 1x1
    convolution of an array: its rows run along the positions)."""
    from .lowering import reshape_index
    x, lay = n.inputs[0], n.attrs["layout"]
    if in_place_taps(L, n):
        sp = [c for c in lay if c not in "NC"]
        osz = [int(L.shape(n)[lay.index(c)]) for c in sp]
        cin_g = int(L.shape(n.inputs[1])[n.attrs["kernel_layout"].index("I")])

        def tap(image, group, red, p):
            xi = [None] * x.rank
            xi[lay.index("N")] = image
            xi[lay.index("C")] = E.iadd(E.imul(group, cin_g), red["I"]) if grouped else red["I"]
            for c, e in zip(sp, reshape_index(osz, (math.prod(osz),), (p,))):
                xi[lay.index(c)] = e
            return L.value(x, xi)
        return tap
    name, _ = conv_taps(L, n, kdims, reduction_first=True)
    return lambda image, group, red, p: Load(n.dtype, name, (image, *([group] if grouped else []),
                                                                  *(red[c] for c in kdims), p))


def _shifted(L, n, kdims, grouped):
    """The padded input, its rows laid end to end (one more row, which the
    last output row's extra positions read), (images, channels, positions);
    the product's tap: a load of it at the tap's shift."""
    from .lowering import _linear, guarded
    x, w = n.inputs
    at, lay, klay = n.attrs, n.attrs["layout"], n.attrs["kernel_layout"]
    sp = [c for c in lay if c not in "NC"]
    xs, ws = L.shape(x), L.shape(w)
    padded = [int(xs[lay.index(c)]) + lo + hi for c, (lo, hi) in zip(sp, at["padding"])]
    padded[0] += 1
    name = f"t{n.id}_pad"
    L.declare_array(name, (xs[lay.index("N")], xs[lay.index("C")], math.prod(padded)), n.dtype)
    iters, idx, bounds = loop_nest((xs[lay.index("N")], xs[lay.index("C")], *padded))
    xi = [None] * len(lay)
    xi[lay.index("N")], xi[lay.index("C")] = idx[0], idx[1]
    for c, i, (lo, _) in zip(sp, idx[2:], at["padding"]):
        xi[lay.index(c)] = E.isub(i, E.const(lo))
    body = guarded(L, x, xi, E.const(0.0, n.dtype), [lay.index(c) for c in sp])
    L.add(name, iters, bounds, (idx[0], idx[1], _linear(padded, idx[2:])), body, "pad", role=TAPS)
    cin_g, dil = int(ws[klay.index("I")]), at.get("dilation") or [1] * len(sp)
    row = [math.prod(padded[k + 1:]) for k in range(len(sp))]

    def tap(image, group, red, p):
        channel = E.iadd(E.imul(group, cin_g), red["I"]) if group is not None else red["I"]
        shift = p
        for k, c in enumerate(sp):
            shift = E.iadd(shift, E.imul(red[c], dil[k] * row[k]))
        return Load(n.dtype, name, (image, channel, shift))
    return tap


