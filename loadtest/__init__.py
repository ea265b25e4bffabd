"""prefixgate: loadtest."""
