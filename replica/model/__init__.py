"""prefixgate: replica.model."""
