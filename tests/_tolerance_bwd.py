"""Thin adapter (see tests/_tolerance.py): the backward rule lives in ``cuflash.testing``."""

from _tolerance import assert_gradients_close  # noqa: F401
