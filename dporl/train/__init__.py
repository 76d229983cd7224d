"""The one training loop every dporl algorithm runs through, its configs and checkpoints."""
