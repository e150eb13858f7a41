"""The Lightning callback: ``from tatblimp_callback.lightning import TatBLiMPLightningCallback``.

A module of its own so that ``import tatblimp_callback`` never imports ``lightning`` (an optional extra:
``pip install tatblimp-callback[lightning]``).
"""

from .training.lightning_callback import TatBLiMPLightningCallback

__all__ = ["TatBLiMPLightningCallback"]
