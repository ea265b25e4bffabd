"""prefixgate: replica.kernels."""
