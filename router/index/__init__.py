"""prefixgate: router.index."""
