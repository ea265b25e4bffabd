"""prefixgate: replica."""
