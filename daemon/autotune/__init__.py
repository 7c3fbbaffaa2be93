"""The auto-tuner: the search (pure decisions) and its runner (rounds as experiments)."""
