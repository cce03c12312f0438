# CUDA backend: not yet.
