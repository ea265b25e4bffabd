"""prefixgate: gateway."""
