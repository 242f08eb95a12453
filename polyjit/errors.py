"""Exceptions a user can act on: each names the argument or option at fault."""


class PolyjitError(Exception):
    """Base class of every error polyjit raises on purpose."""


class CompileOptionError(PolyjitError, ValueError):
    """An unknown compile option, or a value outside the allowed ones."""


class InputError(PolyjitError, ValueError):
    """An argument whose count, rank, shape, dtype or device does not match."""


class UnsupportedOpError(PolyjitError, NotImplementedError):
    """An op outside the supported set, under ``strict=True``."""


class DeviceError(PolyjitError, RuntimeError):
    """The requested target's device or driver is not available."""


class DefinitionError(PolyjitError, ValueError):
    """An op applied to operands it cannot take (shapes, dtypes, axes)."""


class SavedExecutableError(PolyjitError, ValueError):
    """A saved executable that cannot be read or run here: damaged, written
    by another polyjit, or compiled for another machine."""
