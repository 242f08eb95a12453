"""PyTorch frontend: ``torch.compile(backend="polyjit")`` and ``jit_torch``."""
from polyjit.errors import UnsupportedOpError


def polyjit_backend(gm, example_inputs, **kwargs):
    raise UnsupportedOpError("the PyTorch frontend is not built yet")


def jit_torch(fn=None, *, compile_options=None, execution_backend="polyjit"):
    raise UnsupportedOpError("the PyTorch frontend is not built yet")
