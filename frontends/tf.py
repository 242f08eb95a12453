"""TensorFlow frontend: ``jit_tf`` from tf.function graphs."""
from polyjit.errors import UnsupportedOpError


def jit_tf(fn=None, *, input_signature=None, compile_options=None, execution_backend="polyjit"):
    raise UnsupportedOpError("the TensorFlow frontend is not built yet")
