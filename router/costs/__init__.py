"""prefixgate: router.costs."""
