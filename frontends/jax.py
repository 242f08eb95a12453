"""JAX frontend: ``jit_jax`` from jaxprs."""
from polyjit.errors import UnsupportedOpError


def jit_jax(fn=None, *, compile_options=None, static_argnums=(), execution_backend="polyjit"):
    raise UnsupportedOpError("the JAX frontend is not built yet")
