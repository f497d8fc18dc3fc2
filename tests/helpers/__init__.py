"""Set-ups the test modules share (no test module imports another): import as ``from helpers.x import ...``."""
