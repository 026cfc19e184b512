"""PyTorch models written from the model descriptions where transformers has no class (Youtu-VL, the
Youtu MoE in its assumed layout): the references edgevl is verified against."""
