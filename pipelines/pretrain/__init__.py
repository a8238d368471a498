"""Pretraining the tiny worlds' models: resumable stages that reuse the core's EMA, checkpoints and budgets.

``flowalign pretrain-tiny FAMILY`` (``sd3``, ``wan``, ``kontext``, ``kontext_sr``, ``anyflow_far``, ``qwen_image_edit``) (:mod:`pipelines.pretrain.cli`) runs :mod:`pipelines.pretrain.run`.
"""
