"""The one training loop every dporl algorithm runs through, its configs, weights-only checkpoints, run directories
(release/ vs curator/, provenance, the privacy journal) and policy export."""
