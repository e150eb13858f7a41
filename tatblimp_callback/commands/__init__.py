"""The tatblimp command's sub-commands: score's loading, sweep, compare, explain; models and checkpoints."""
