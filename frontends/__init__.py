"""Framework frontends, imported as ``polyjit.frontends.<framework>``.

Each frontend translates a framework program into a polyjit graph through
one table from framework ops to core ops, and runs the compiled Executable
on the framework's tensors. The core never imports a framework.
"""


def __getattr__(name: str):
    """``polyjit.frontends.torch`` and the others load when first named."""
    if name in ("torch", "jax", "tf"):
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
