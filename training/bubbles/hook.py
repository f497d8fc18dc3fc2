"""The one line in a training: ``from bubbles.hook import instrument``; ``instrument(engine)``.

This module is the hook's public face and holds no code of its own: the hook lives in ``bubbles.training.hook``.
The names here are the ones the README and the docs promise; everything else may move between releases.
"""

from bubbles.training.hook import Instrumentation, instrument

__all__ = ["Instrumentation", "instrument"]
