"""The x86 int8 paths ptq keeps a model right on, in one place: which path a CPU takes (cpu.py), how a runtime reaches
the other (paths.py: each backend's Int8Paths), how the other path's kernels run here at all (emulate.py: the CPUID
shim, qemu), and the plan evaluate, benchmark and `ptq run` read (plan.py). It imports nothing above it: backends
declare their Int8Paths with it, services hand it what it reads."""
