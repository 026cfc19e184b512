"""Weights must be finite: NaN or infinite values are refused naming the tensor and row (and the
expert of a fused expert tensor); huge finite values still convert."""

import pytest

import edgevl
from support.convert import copy_ck, demo_copy, refused_before_writing
from support.youtu import TINY, make_youtu


def poison(ck, name_part: str, value: float, row: int = 1) -> str:
    """Put ``value`` into one element of the first tensor whose name contains ``name_part``."""
    from safetensors.torch import load_file, save_file

    path = ck / "model.safetensors"
    t = load_file(str(path))
    name = next(k for k in sorted(t) if name_part in k)
    t[name] = t[name].clone()
    t[name].view(t[name].shape[0], -1)[row, -1] = value
    path.unlink()  # it may be a link to the shipped weights
    save_file(t, str(path), metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("source", ["fp32", "bf16"])
def test_nan_or_inf_weights_are_refused_naming_the_tensor(tmp_path, capsys, value, source):
    """Were converted: the demo then answered '' (every logit NaN)."""
    if source == "fp32":
        ck = demo_copy(tmp_path / "ck")
    else:
        ck = make_youtu(tmp_path / "ck", seed=1, dtype="bf16", **TINY)
    name = poison(ck, "mlp.down_proj", value, row=3)
    refused_before_writing(capsys, ck, tmp_path, f"tensor {name} in model.safetensors holds NaN or infinite values "
                                                 "(row 3)", "re-download it")


def test_nan_in_a_fused_expert_is_refused_naming_the_expert(tmp_path, capsys):
    """Routed experts are read through their own slices of the fused [E, 2I, H] tensor."""
    from safetensors.torch import load_file, save_file

    from edgevl.verification.families.youtu_moe import VERIFY as ARCH

    ck = ARCH.make_tiny(tmp_path / "ck", seed=1)

    t = load_file(str(ck / "model.safetensors"))
    name = next(k for k in sorted(t) if k.endswith("experts.gate_up_proj"))
    t[name] = t[name].clone()
    t[name][5, 7, 0] = float("nan")
    save_file(t, str(ck / "model.safetensors"), metadata={"format": "pt"})
    refused_before_writing(capsys, ck, tmp_path, f"tensor {name} (expert 5) in model.safetensors holds NaN or "
                                                 "infinite values (row 7)")


def test_finite_weights_of_any_size_still_convert(tiny, tmp_path):
    """Huge finite values (the sum of squares overflows) are not mistaken for infinity."""
    ck = copy_ck(tiny[0], tmp_path / "ck")
    name = poison(ck, "mlp.down_proj", 3e38, row=0)
    out = edgevl.convert(ck, tmp_path / "out", dtype="fp32", progress=False)
    assert (out / "manifest.json").is_file(), name
