"""prefixgate: loadtest.bench."""
