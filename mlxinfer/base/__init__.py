"""The ground floor, below every stage and importing none: the one exception hierarchy, argument
checks, files written whole, the BLAS MLX binds, model work cut into slices, our cache folder, and
the safetensors header read as untrusted input."""
