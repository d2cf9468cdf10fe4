"""reshard: parallel weight resharding from RL trainers to inference engines."""

__version__ = "0.1.0"
