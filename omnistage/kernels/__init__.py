"""Native CPU kernels: C sources shipped with the package, compiled on first use by the
machine's C compiler for its own CPU, cached on disk, and called through ctypes. Each has a
plain-PyTorch counterpart that serves wherever the kernel does not (other devices and dtypes,
no compiler)."""
