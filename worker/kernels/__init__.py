"""The CPU kernels this project writes in C, for float32 on AVX-512 or AVX2 CPUs: the C sources and
headers, their build (native.py) and one binding a kernel (its ctypes signature and a typed wrapper
over tensors). Imports torch only: models/ and engine/ call in, never the reverse."""
