"""Pretraining the tiny worlds' models: resumable stages that reuse the core's EMA, checkpoints and budgets.

``flowalign pretrain-tiny {sd3,wan,kontext}`` (:mod:`pipelines.pretrain.cli`) runs :mod:`pipelines.pretrain.run`.
"""
