"""The x86 int8 paths ptq keeps a model right on: which path a CPU takes lives in cpu.py (every layer reads it); how the
other path is reached here (the CPUID shim, qemu) lives in emulate.py. Services read
both; the quantization engine's judges get the other path handed down (cpu.reaching_saturating_path)."""
