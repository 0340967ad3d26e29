"""Several sessions' caches decoded as one batch: parts, slabs and padded rows."""
