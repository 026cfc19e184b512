"""edgevl: run multimodal LLMs on CPUs through ncnn, verified against PyTorch.

    import edgevl
    model = edgevl.load("youtu-vl-ncnn/")
    print(edgevl.generate(model, "Describe the image.", image="photo.jpg"))
"""

__version__ = "0.2.0"

from .batch import batch
from .boxes import Box
from .convert import convert
from .errors import EdgevlError
from .generate import Completion, complete, generate, stream_choices, stream_events, stream_generate
from .model import Model, load

__all__ = ["load", "generate", "stream_generate", "stream_events", "stream_choices", "complete", "Completion", "Box",
           "convert", "batch", "Model", "EdgevlError"]
