"""config.json, the tokenizer files and preprocessor_config.json are checked before anything is
written: wrong types and values give one line, and a vision checkpoint converts only into a
package that takes images (its processor settings fit the tower, the image token is a token,
vision weights come with a vision_config); values of every type that real configs hold still
convert."""

import json
import math
import shutil

import pytest

import edgevl
from support.cli import cli, one_line_error
from support.convert import copy_ck, demo_copy, refused_before_writing
from support.files import edit_json, package_digest


def _cfg(fn):
    return lambda ck: edit_json(ck / "config.json", fn)


def _put(**kv):
    return _cfg(lambda c: c.update(kv))


def _index(ck, text):
    """An index in place of model.safetensors (transformers reads an index only where there is none)."""
    (ck / "model.safetensors").rename(ck / "model-00001-of-00001.safetensors")
    (ck / "model.safetensors.index.json").write_text(text)


CONFIG_CASES = [  # (id, edit of the checkpoint folder, words of the error)
    ("config-is-a-list", _cfg(lambda c: [c]), "config.json must be a JSON object"),
    ("layers-4.5", _put(num_hidden_layers=4.5), "num_hidden_layers must be a positive integer, got 4.5"),
    ("vocab-string", _put(vocab_size="713"), "vocab_size must be a positive integer, got '713'"),
    ("zero-layers", _put(num_hidden_layers=0), "num_hidden_layers must be a positive integer, got 0"),
    ("negative-heads", _put(num_attention_heads=-2), "num_attention_heads must be a positive integer"),
    ("bool-hidden", _put(hidden_size=True), "hidden_size must be a positive integer, got True"),
    ("q-lora-string", _put(q_lora_rank="none"), "q_lora_rank must be a positive integer or null"),
    ("eps-negative", _put(rms_norm_eps=-1e-6), "rms_norm_eps must be a positive number"),
    ("eps-nan", lambda ck: (ck / "config.json").write_text(
        (ck / "config.json").read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN')),
     "rms_norm_eps must be a positive number, got nan"),
    ("tie-string", _put(tie_word_embeddings="yes"), "tie_word_embeddings must be true or false"),
    ("act-number", _put(hidden_act=7), "hidden_act must be a string"),
    ("rope-theta-string", _cfg(lambda c: c["rope_parameters"].update(rope_theta="abc")),
     "rope_theta must be a positive number"),
    ("rope-parameters-list", _put(rope_parameters=[1]), "rope_parameters must be an object"),
    ("rope-scaling-beside-parameters", _put(rope_scaling={"type": "yarn", "factor": 4.0}),   # not ignored
     "rope_type 'yarn' in config.json is not supported"),
    ("eos-string", _put(eos_token_id="x"), "eos_token_id must be a token id"),
    ("eos-negative-in-list", _put(eos_token_id=[1, -1]), "eos_token_id must be a token id"),
    ("model-type-list", _put(model_type=["youtu"], architectures=5), "is not supported"),
    ("config-not-utf8", lambda ck: (ck / "config.json").write_bytes(b"\xff\xfe{}"), "is not valid JSON"),
    ("generation-config-eos", lambda ck: edit_json(ck / "generation_config.json",
                                                   lambda g: g.update(eos_token_id={"a": 1})),
     "generation_config.json field eos_token_id"),
    ("no-tokenizer", lambda ck: (ck / "tokenizer.json").unlink(), "has no tokenizer.json"),
    ("garbage-tokenizer", lambda ck: (ck / "tokenizer.json").write_text("{not json"), "could not be read"),
    ("tokenizer-config-garbage", lambda ck: (ck / "tokenizer_config.json").write_text("[1, 2"),
     "tokenizer_config.json is not valid JSON"),
    ("tokenizer-config-list", lambda ck: (ck / "tokenizer_config.json").write_text("[1, 2]"),
     "tokenizer_config.json must be a JSON object"),
    ("template-syntax", lambda ck: (ck / "chat_template.jinja").write_text("{% for m in messages %}{{ m"),
     "chat template"),
    ("index-escapes", lambda ck: _index(ck, json.dumps({"weight_map": {"a": "../../etc/passwd"}})), "not a file name"),
    ("index-list", lambda ck: _index(ck, "[1]"), "not a valid safetensors index"),
]


@pytest.mark.parametrize("case", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_or_tokenizer_fails_before_writing(tiny, tmp_path, capsys, case):
    ck = copy_ck(tiny[0], tmp_path / "ck")
    case[1](ck)
    one_line_error(*cli(capsys, "convert", ck, tmp_path / "out", "--quiet")[::2], case[2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # not even a work folder


@pytest.mark.parametrize("case", [
    ("vision-heads-0", lambda v: v.update(num_attention_heads=0), "vision_config field num_attention_heads"),
    ("vision-fullatt-strings", lambda v: v.update(fullatt_block_indexes=["1"]), "fullatt_block_indexes"),
    ("vision-config-list", None, "vision_config must be a JSON object"),
], ids=lambda c: c[0])
def test_bad_vision_config(tmp_path, capsys, case):
    from edgevl.demo import demo_checkpoint

    ck = tmp_path / "vl"
    ck.mkdir()
    for f in demo_checkpoint().iterdir():
        if f.name == "config.json":
            shutil.copy(f, ck / f.name)
        else:
            (ck / f.name).symlink_to(f)
    edit = case[1]
    edit_json(ck / "config.json", lambda c: edit(c["vision_config"]) if edit else c.update(vision_config=[1]))
    one_line_error(*cli(capsys, "convert", ck, tmp_path / "out", "--quiet")[::2], case[2])
    assert not (tmp_path / "out").exists()


def test_good_config_values_of_every_type_still_convert(tiny, tmp_path):
    """The checks accept what real configs hold: ints for floats, null optionals, big thetas."""
    ck = copy_ck(tiny[0], tmp_path / "ck")
    edit_json(ck / "config.json", lambda c: c["rope_parameters"].update(rope_theta=500000))
    assert isinstance(json.loads((ck / "config.json").read_text())["rope_parameters"]["rope_theta"], int)
    out = edgevl.convert(ck, tmp_path / "out", dtype="fp32", progress=False)
    assert package_digest(out)["decoder.bin"] == package_digest(tiny[1])["decoder.bin"]
    assert math.isclose(edgevl.load(out).manifest["graphs"]["decoder"]["extra"]["rope_theta"], 500000.0)


# -- a package that converts must take images (or know it has none) --------------------------

@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    """A tiny Qwen3.5 VL checkpoint (vision tower, preprocessor_config.json)."""
    from edgevl.verification.families.qwen3_5 import VERIFY as ARCH

    return ARCH.make_tiny(tmp_path_factory.mktemp("hostile-qwen") / "ck", seed=1)


def test_vl_checkpoint_without_a_fitting_preprocessor_config_is_refused(qwen_vl, tmp_path, capsys):
    """Converted anyway, the package failed to load with "sizes differ from the vision tower's"
    (the fallback processor settings are Qwen2-VL's patch 14, not the tower's 16)."""
    ck = copy_ck(qwen_vl, tmp_path / "ck")
    (ck / "preprocessor_config.json").unlink()
    refused_before_writing(capsys, ck, tmp_path, "has no preprocessor_config.json",
                           "copy it from the model's original files")
    shutil.copy(qwen_vl / "preprocessor_config.json", ck)
    edit_json(ck / "preprocessor_config.json", lambda p: p.update(patch_size=14))
    refused_before_writing(capsys, ck, tmp_path, "patch/merge/temporal sizes 14/2/2 differ from vision_config's 16/2/2")
    (ck / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16, "size": [1]}))
    refused_before_writing(capsys, ck, tmp_path, "preprocessor_config.json holds a value of the wrong type")


def test_processor_settings_saved_by_transformers_5_in_processor_config_json(qwen_vl, tmp_path, capsys):
    """transformers 5 saves a checkpoint's processors together in processor_config.json (image
    and video entries) and reads those first; such a checkpoint was refused as having no image
    processor settings. The package takes what transformers' own readers take."""
    from PIL import Image
    from transformers.image_processing_base import ImageProcessingMixin
    from transformers.video_processing_utils import BaseVideoProcessor

    ck = copy_ck(qwen_vl, tmp_path / "ck")
    image = json.loads((ck / "preprocessor_config.json").read_text())
    video = json.loads((ck / "video_preprocessor_config.json").read_text())
    small = {**image, "max_pixels": 64 * 64, "size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}}
    (ck / "processor_config.json").write_text(json.dumps({"image_processor": small,
                                                          "video_processor": {**video, "fps": 1.5}}))
    (ck / "video_preprocessor_config.json").unlink()
    # the flat file stays beside it (with its larger budget): the nested entry is what is read
    assert ImageProcessingMixin.get_image_processor_dict(str(ck))[0] == small
    assert BaseVideoProcessor.get_video_processor_dict(str(ck))[0]["fps"] == 1.5
    model = edgevl.load(edgevl.convert(ck, tmp_path / "pk", dtype="fp32", progress=False))
    _, (info,) = model.encode_images([Image.new("RGB", (400, 300), "teal")])
    t, h, w = info["grid_thw"]
    assert h * w * 16 * 16 <= 64 * 64 < (h + 2) * (w + 2) * 16 * 16, info
    assert model.vision.video_cfg.fps == 1.5
    model.close()
    (ck / "preprocessor_config.json").unlink()       # the nested entry alone is enough
    edgevl.convert(ck, tmp_path / "pk2", dtype="fp32", progress=False)
    image = tmp_path / "teal.png"
    Image.new("RGB", (400, 300), "teal").save(image)
    code, out, err = cli(capsys, "verify", tmp_path / "pk2", "--reference", ck, "--image", image, "--max-new-tokens", 4)
    assert code == 0 and "PASS" in out, (out, err)     # the reference reads the settings where transformers does


def test_a_package_or_a_hub_cache_folder_given_as_the_checkpoint_is_named(tiny, tmp_path, capsys):
    """A package (it holds config.json too) was said to have no safetensors weights, and the top
    of huggingface_hub's cache to have no config.json: the fix was not in either message."""
    ck, pkg = tiny
    one_line_error(*cli(capsys, "convert", pkg, tmp_path / "out")[::2], "is an edgevl package already",
                   "convert the checkpoint it came from")
    repo = tmp_path / "hub" / "models--org--name"
    for rev in ("0a1b", "9f8e"):
        (repo / "snapshots" / rev).mkdir(parents=True)
        for f in ck.iterdir():
            (repo / "snapshots" / rev / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0a1b")
    for given in (repo, repo / "snapshots"):
        one_line_error(*cli(capsys, "convert", given, tmp_path / "out")[::2], "is a Hugging Face cache folder",
                       f"pass one of its snapshots, such as {repo / 'snapshots' / '0a1b'}")
    code, out, _ = cli(capsys, "convert", repo / "snapshots" / "0a1b", tmp_path / "out")
    assert code == 0 and out.startswith(f"wrote {tmp_path / 'out'} (bf16, ") and " MiB, " in out, out


def test_youtu_vl_without_preprocessor_config_takes_images_with_its_processor_defaults(tmp_path):
    """Youtu-VL's processor settings come from the tower (patch, merge) and the HF processor's
    defaults (mean/std 0.5, 36864 patches), so its package works without the file."""
    from PIL import Image

    ck = demo_copy(tmp_path / "ck")
    (ck / "preprocessor_config.json").unlink()
    model = edgevl.load(edgevl.convert(ck, tmp_path / "pk", dtype="fp32", progress=False))
    assert model.vision.default_max_patches == 36864
    rows, info = model.vision(Image.new("RGB", (128, 128), "white"))
    assert info["spatial_shapes"] == (8, 8) and len(rows) == 16


@pytest.mark.parametrize("value", [713, 10 ** 6, 2 ** 40])
def test_image_token_id_outside_the_tokenizer_is_refused(tmp_path, capsys, value):
    """Was converted; every image prompt then had "0 image placeholders" at run time."""
    ck = demo_copy(tmp_path / "ck")
    edit_json(ck / "config.json", lambda c: c.update(image_token_id=value))
    refused_before_writing(capsys, ck, tmp_path,
                           f"image_token_id {value} is not a token of tokenizer.json (713 tokens)")


def test_image_token_id_list_is_refused(tmp_path, capsys):
    ck = demo_copy(tmp_path / "ck")
    edit_json(ck / "config.json", lambda c: c.update(image_token_id=[4]))
    refused_before_writing(capsys, ck, tmp_path, "image_token_id must be one token id")


def test_vision_weights_without_vision_config_are_refused(qwen_vl, tmp_path, capsys):
    """Qwen3.5 became a text-only package without a word; Youtu-VL named only the config."""
    words = "the checkpoint has vision weights but config.json has no vision_config"
    ck = copy_ck(qwen_vl, tmp_path / "qwen")
    edit_json(ck / "config.json", lambda c: {k: v for k, v in c.items() if k != "vision_config"})
    refused_before_writing(capsys, ck, tmp_path, words)
    ck = demo_copy(tmp_path / "youtu")
    edit_json(ck / "config.json", lambda c: c.update(vision_config=None))
    refused_before_writing(capsys, ck, tmp_path, words)


@pytest.mark.parametrize("bad, words", [("abc", "vision_config must be a JSON object, got str"),
                                        ({"rope_parameters": [1]}, "vision_config.rope_parameters must be a JSON")])
def test_a_qwen_vision_config_that_is_not_an_object(qwen_vl, tmp_path, capsys, bad, words):
    ck = copy_ck(qwen_vl, tmp_path / "ck")
    edit_json(ck / "config.json", lambda c: c.update(vision_config=bad if isinstance(bad, str)
                                                     else {**c["vision_config"], **bad}))
    refused_before_writing(capsys, ck, tmp_path, words)


def test_weights_linked_to_a_deleted_blob(tmp_path, capsys):
    """A Hugging Face cache folder links its weights to blobs: a deleted blob is named, with the fix."""
    from edgevl.demo import DEMO_CHECKPOINT

    ck = tmp_path / "ck"
    ck.mkdir()
    for f in DEMO_CHECKPOINT.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, ck / f.name)
    (ck / "model.safetensors").symlink_to(tmp_path / "blobs" / "deleted")
    refused_before_writing(capsys, ck, tmp_path, "which is gone", "download the checkpoint again")


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "generation_config.json", "chat_template.jinja",
                                  "processor_config.json"])
def test_a_snapshot_file_not_downloaded_yet_is_named(tmp_path, capsys, name):
    """Another file's dangling link read as a file the checkpoint lacks: "has no config.json; pass
    the folder of a checkpoint", or worse, no word (the generation defaults and eos dropped, the
    built-in template used)."""
    from edgevl.demo import DEMO_CHECKPOINT

    snap = tmp_path / "models--org--name" / "snapshots" / "0a1b"
    snap.mkdir(parents=True)
    for f in DEMO_CHECKPOINT.iterdir():
        shutil.copy(f, snap / f.name)
    (snap / name).unlink(missing_ok=True)
    (snap / name).symlink_to(tmp_path / "models--org--name" / "blobs" / "4f5e")
    refused_before_writing(capsys, snap, tmp_path, f"{name} is a link to", "which is gone (a download not finished",
                           "download the checkpoint again")


def test_weights_still_downloading_are_named(tmp_path, capsys):
    """The only weights a snapshot has are still downloading (huggingface_hub writes the blob as
    <sha>.incomplete and links it when done): the advice was to save with safe_serialization."""
    from edgevl.demo import DEMO_CHECKPOINT

    repo = tmp_path / "models--org--name"
    snap = repo / "snapshots" / "0a1b"
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "9c8d.incomplete").write_bytes(b"\0" * 100)
    for f in DEMO_CHECKPOINT.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, snap / f.name)
    refused_before_writing(capsys, snap, tmp_path, "has no *.safetensors weights yet", "9c8d.incomplete",
                           "let the download finish")


def test_a_checkpoint_without_a_chat_template_is_said_at_convert_and_run(tiny, tmp_path, capsys):
    """A base model has no chat template, a partial download may lack it: conversion goes on and
    says so, and `run` says its prompt goes as plain text."""
    ck = copy_ck(tiny[0], tmp_path / "ck")
    (ck / "chat_template.jinja").unlink(missing_ok=True)
    edit_json(ck / "tokenizer_config.json", lambda t: t.pop("chat_template", None))
    code, _, err = cli(capsys, "convert", ck, tmp_path / "out")
    assert code == 0 and "has no chat template" in err and "add it to the folder and convert again" in err, err
    code, _, err = cli(capsys, "run", tmp_path / "out", "--prompt", "Hello", "--max-new-tokens", "2")
    assert code == 0 and "no chat template, so the prompt goes to it as plain text" in err, err
    code, _, err = cli(capsys, "run", tmp_path / "out", "--prompt", "Hello", "--max-new-tokens", "2", "--raw")
    assert code == 0 and "chat template" not in err, err
    code, _, err = cli(capsys, "run", tiny[1], "--prompt", "Hello", "--max-new-tokens", "2")
    assert code == 0 and "chat template" not in err, err


def test_head_counts_that_do_not_divide_are_named_with_their_values(qwen_vl, tmp_path, capsys):
    """A config that leaves out num_key_value_heads gets the default 4: "value heads must be a
    multiple of key heads" did not say which count, nor that one was a default."""
    ck = copy_ck(qwen_vl, tmp_path / "ck")

    def drop(c):
        c["text_config"].pop("num_key_value_heads", None)
        c["text_config"]["num_attention_heads"] = 2
    edit_json(ck / "config.json", drop)
    refused_before_writing(capsys, ck, tmp_path, "num_attention_heads 2 over num_key_value_heads 4",
                           "a key the config leaves out takes transformers' default")


def test_token_ids_in_the_text_config_are_checked(qwen_vl, tmp_path, capsys):
    """Vision-language configs keep eos_token_id in text_config, which the runtime now reads: a
    malformed one was converted and stopped every load."""
    ck = copy_ck(qwen_vl, tmp_path / "ck")
    edit_json(ck / "config.json", lambda c: c["text_config"].update(eos_token_id=[5, None]))
    refused_before_writing(capsys, ck, tmp_path, "config.json text_config field eos_token_id must be a token id")
