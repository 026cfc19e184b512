"""The verification wing: what proves edgevl right, apart from what runs it.

PyTorch references (transformers' classes where they exist, the project's own models written from
the model descriptions where they do not: ``references/``), the tiny random checkpoints every
test builds (``tiny.py``, ``tokenizers.py`` and one module per family in ``families/``), the
layer-by-layer comparison behind ``edgevl verify`` (``verify.py``) and the shipped demo model's
training and evaluation (``demo_train.py``, ``demo_evaluate.py``). It imports the models; nothing
in the runtime imports it. Needs PyTorch and transformers (``pip install edgevl[verify]``).
"""

from __future__ import annotations

import importlib


def get(name: str):
    """The verification (:class:`reference.FamilyVerification`) of the registered family ``name``."""
    from .. import models

    models.get(name)      # a family this edgevl knows, else the registry's one-line error
    return importlib.import_module(f"{__name__}.families.{name}").VERIFY
