"""Building a program op by op, as with nvFuser's FusionDefinition."""
import numpy as np

from polyjit import DataType, FusionDefinition

with FusionDefinition() as fd:
    t0 = fd.define_tensor(symbolic_sizes=[-1, 1, -1], contiguous=[True] * 3, dtype=DataType.Float)
    t1 = fd.define_tensor(3)
    c0 = fd.define_constant(3.0)
    t4 = fd.ops.sum(fd.ops.mul(fd.ops.add(t0, t1), c0), [-1], False, DataType.Float)
    fd.add_output(t4)

a = np.ones((2, 1, 8), np.float32)
b = np.ones((2, 4, 8), np.float32)
out = fd.execute([a, b])[0]
print("result", out.shape, out[0, 0], "stats", fd.stats)
fd.print()
fd.print_ir()
