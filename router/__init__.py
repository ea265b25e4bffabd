"""prefixgate: router."""
