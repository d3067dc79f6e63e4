"""Test support, not shipped with the package: local gloo worlds and tiny model checkpoints."""
