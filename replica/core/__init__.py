"""prefixgate: replica.core."""
