"""PyTorch references used only for verification (``pip install edgevl[verify]``)."""
