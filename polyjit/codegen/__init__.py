"""LLVM code generation: one emitter shared by every target (llvm.py), and a
small module per target (cpu.py; nvgpu.py) for what differs."""
