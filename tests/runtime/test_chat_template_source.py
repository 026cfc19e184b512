"""Which file a checkpoint's chat template comes from, as transformers takes it: chat_template.jinja
first; a text model's tokenizer then reads tokenizer_config.json (chat_template.json is a processor's
file), a vision model's processor chat_template.json first."""

import json

import pytest

from edgevl.tokenizer import Tokenizer
from support.youtu import make_youtu

A, B, C = "{{ 'from json' }}", "{{ 'from tokenizer_config' }}", "{{ 'from jinja' }}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_youtu(tmp_path_factory.mktemp("tpl") / "ck", seed=2)


def _write(folder, json_tpl=None, cfg_tpl=None, jinja=None):
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    if cfg_tpl is not None:
        cfg["chat_template"] = cfg_tpl
    cfg_path.write_text(json.dumps(cfg))
    for name, body in (("chat_template.json", json.dumps({"chat_template": json_tpl}) if json_tpl else None),
                       ("chat_template.jinja", jinja)):
        (folder / name).unlink(missing_ok=True)
        if body is not None:
            (folder / name).write_text(body)


@pytest.mark.parametrize("files", [dict(json_tpl=A, cfg_tpl=B), dict(json_tpl=A, cfg_tpl=B, jinja=C),
                                   dict(cfg_tpl=B), dict(jinja=C, cfg_tpl=B)])
def test_a_text_models_template_is_the_one_its_transformers_tokenizer_reads(folder, files):
    from transformers import AutoTokenizer

    _write(folder, **files)
    want = AutoTokenizer.from_pretrained(folder).chat_template
    assert want is not None
    assert Tokenizer(folder, processor=False).chat_template == want


def test_a_vision_models_processor_reads_chat_template_json_first_and_a_lone_file_serves_both(folder):
    _write(folder, json_tpl=A, cfg_tpl=B)
    assert Tokenizer(folder, processor=True).chat_template == A
    _write(folder, json_tpl=A, cfg_tpl=B, jinja=C)
    assert Tokenizer(folder, processor=True).chat_template == C
    _write(folder, json_tpl=A)       # transformers' tokenizer would have none: the file is used
    assert Tokenizer(folder, processor=False).chat_template == A
    _write(folder, cfg_tpl=B)
    assert Tokenizer(folder, processor=True).chat_template == B
