"""Tiny builders, one module per tiny model (see :mod:`pipelines.tiny`).

Each module has ``build(**overrides)``, returning a diffusers pipeline of the real classes with the published
configs (:mod:`pipelines.tiny_twins.published`) shrunk, and ``SAMPLING`` (the ``flowalign.json`` defaults
written next to it). A family's spec names its modules (:attr:`flowalign.families.FamilySpec.tiny`); they are
imported on use, so listing the tiny models loads none of them.
"""
