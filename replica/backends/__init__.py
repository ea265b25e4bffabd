"""prefixgate: replica.backends."""
