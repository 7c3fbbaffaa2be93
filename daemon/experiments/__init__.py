"""A/B experiments: specs, the forked, cluster and interleaved runners, blocks and statistics."""
