"""Bad input and bad options: clear errors, raised before anything runs."""
import numpy as np
import pytest

import polyjit
from polyjit import FusionDefinition, InputInfo, ops
from polyjit.errors import CompileOptionError, DefinitionError, InputError

F32 = np.float32


@pytest.fixture
def exe():
    return polyjit.compile(lambda a, b: a + b, [InputInfo([4, -1], F32), InputInfo([-1], F32)])


def test_wrong_count(exe):
    with pytest.raises(InputError, match="expected 2 inputs, got 1"):
        exe(np.zeros((4, 3), F32))


def test_wrong_rank(exe):
    with pytest.raises(InputError, match="input 1 has rank 2"):
        exe(np.zeros((4, 3), F32), np.zeros((4, 3), F32))


def test_wrong_dtype(exe):
    with pytest.raises(InputError, match="input 0 has dtype float64, expected float32"):
        exe(np.zeros((4, 3)), np.zeros(3, F32))


def test_wrong_static_size(exe):
    with pytest.raises(InputError, match="input 0 .*expected size 4 in dimension 0"):
        exe(np.zeros((5, 3), F32), np.zeros(3, F32))


def test_mismatched_symbolic_sizes(exe):
    with pytest.raises(InputError, match="input 1 dimension 0 is 7"):
        exe(np.zeros((4, 3), F32), np.zeros(7, F32))


def test_not_an_array(exe):
    with pytest.raises(InputError, match="input 0 is a list"):
        exe([[1.0]], np.zeros(3, F32))


def test_checked_after_a_good_call(exe, rng):
    """Calls are planned once per signature; a later bad call still fails, and
    a strided view gets the plan of its own layout."""
    a, b = rng.random((4, 3), dtype=F32), rng.random(6, dtype=F32)
    np.testing.assert_array_equal(exe(a, b[:3]), a + b[:3])
    np.testing.assert_array_equal(exe(a, b[::2]), a + b[::2])
    with pytest.raises(InputError, match="input 1 dimension 0 is 6"):
        exe(a, b)
    with pytest.raises(InputError, match="input 0 has dtype float64"):
        exe(a.astype(np.float64), b[:3])
    np.testing.assert_array_equal(exe(a[:, :2], b[:2]), a[:, :2] + b[:2])


def test_outputs_untouched_inputs_unmodified(exe, rng):
    a, b = rng.random((4, 3), dtype=F32), rng.random(3, dtype=F32)
    a0, b0 = a.copy(), b.copy()
    exe(a, b)
    np.testing.assert_array_equal(a, a0)
    np.testing.assert_array_equal(b, b0)


@pytest.mark.parametrize("opts,match", [
    ({"targett": "cpu"}, "unknown compile option 'targett'"),
    ({"target": "tpu"}, "'target' is 'tpu'; allowed values"),
    ({"fusion": "some"}, "'fusion' is 'some'"),
    ({"num_threads": 0}, "'num_threads' is 0"),
    ({"tile_sizes": [0, 4]}, "'tile_sizes'"),
    ({"debug": "yes"}, "'debug' is 'yes'"),
])
def test_bad_options(opts, match):
    with pytest.raises(CompileOptionError, match=match):
        polyjit.compile(ops.exp, [InputInfo([3], F32)], opts)


def test_definition_errors():
    with pytest.raises(DefinitionError, match="do not match"):
        polyjit.compile(lambda a, b: a + b, [InputInfo([3], F32), InputInfo([4], F32)])
    with pytest.raises(DefinitionError, match="cannot reshape"):
        polyjit.compile(lambda a: ops.reshape(a, [7]), [InputInfo([2, 3], F32)])
    with pytest.raises(DefinitionError, match="out of range"):
        polyjit.compile(lambda a: ops.sum(a, [3]), [InputInfo([2, 3], F32)])
    with pytest.raises(DefinitionError, match="truth value"):
        polyjit.compile(lambda a: a if a > 0 else a, [InputInfo([2], F32)])
    with pytest.raises(DefinitionError, match="no outputs"):
        with FusionDefinition() as fd:
            fd.define_tensor(2)
        fd.execute([np.zeros((2, 2), F32)])
