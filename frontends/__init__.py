"""Framework frontends, imported as ``polyjit.frontends.<framework>``.

Each frontend translates a framework program into a polyjit graph through
one table from framework ops to core ops, and runs the compiled Executable
on the framework's tensors. The core never imports a framework.
"""
