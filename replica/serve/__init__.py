"""prefixgate: replica.serve."""
