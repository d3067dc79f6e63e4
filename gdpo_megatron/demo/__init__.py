"""The CPU demo: a tiny model learns a bundled multi-reward tool-calling task."""
