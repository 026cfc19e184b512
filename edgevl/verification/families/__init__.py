"""One module per model family (named as the family): its ``VERIFY``, a
:class:`edgevl.verification.reference.FamilyVerification` (PyTorch reference, tiny checkpoints)."""
