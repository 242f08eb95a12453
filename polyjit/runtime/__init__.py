"""Running compiled programs on the caller's arrays: executables and their
call plans (``program``), host buffers (``buffers``)."""
from .buffers import BufferCache
from .program import CompiledProgram, RowMajor

__all__ = ["BufferCache", "CompiledProgram", "RowMajor"]
