"""Adapters that plug this project's GDPO math into other RL frameworks."""
