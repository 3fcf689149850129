"""Graph transforms: rewrites of a model's graph that keep what it computes (or bound it), used by the backends."""
