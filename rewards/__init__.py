"""Reward functions and models; each implements :class:`flowalign.protocols.Reward`."""

from rewards.registry import available, load, register

__all__ = ["available", "load", "register"]
