"""Targets: what each one (cpu, nvgpu) does to a program that the others do not."""
