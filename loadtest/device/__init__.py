"""prefixgate: loadtest.device."""
