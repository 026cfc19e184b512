"""Qwen3.5's multi-token-prediction (MTP) block in PyTorch, for Qwen3.5 and Qwen3.5-MoE.

transformers loads neither the block nor its tensors (they sit under ``mtp.`` in the checkpoint's
safetensors and are ignored on load), so this module composes it from transformers' own classes
of the family: the zero-centred RMSNorm (x̂·(1 + w)), one full-attention decoder layer
(``Qwen3_5DecoderLayer``, or ``Qwen3_5MoeDecoderLayer`` with the sparse MoE block) and the text
rotary embedding (interleaved M-RoPE over three position axes).

Row i of the block pairs the embedding of token i+1 with the main model's last hidden state at i
(after its final norm) and predicts token i+2 through the main model's lm_head::

    x   = fc(concat[pre_fc_norm_embedding(embed(t[i+1])), pre_fc_norm_hidden(h[i])])
    y   = norm(layer(x))          # at token i's position; causal over the block's rows 0..i

For image prompts ``embed(t[i+1])`` of an image-token row is that row's merged vision embedding.
A recursive draft takes the argmax token's embedding and the previous row's output ``y`` at the
next position.

Tensors on disk (``mtp_num_hidden_layers`` = 1): ``mtp.fc.weight`` [H, 2H],
``mtp.pre_fc_norm_embedding.weight``, ``mtp.pre_fc_norm_hidden.weight``, ``mtp.norm.weight`` [H],
and ``mtp.layers.0.*`` named as a main full-attention layer stores them (the MoE experts one
tensor per expert and projection, ``mlp.experts.{e}.{gate,up,down}_proj.weight``).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch
from torch import nn

from ...errors import EdgevlError

PREFIX = "mtp."
_FUSED_EXPERTS = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def is_moe(text_config) -> bool:
    """Whether a Qwen3.5 text config is the MoE family's (``qwen3_5_moe_text``)."""
    return "moe" in str(getattr(text_config, "model_type", ""))


def _classes(moe: bool):
    if moe:
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

        return m.Qwen3_5MoeRMSNorm, m.Qwen3_5MoeDecoderLayer, m.Qwen3_5MoeTextRotaryEmbedding
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    return m.Qwen3_5RMSNorm, m.Qwen3_5DecoderLayer, m.Qwen3_5TextRotaryEmbedding


class Qwen3_5Mtp(nn.Module):
    """The MTP block of a Qwen3.5 (``moe=False``) or Qwen3.5-MoE (``moe=True``) text config.

    Parameter names are transformers' in-memory ones (the MoE experts fused as ``gate_up_proj``
    [E, 2I, H] and ``down_proj`` [E, H, I]); :meth:`state_dict_for_checkpoint` and :meth:`load`
    translate to and from the names on disk."""

    def __init__(self, text_config, moe: bool):
        super().__init__()
        n_layers = getattr(text_config, "mtp_num_hidden_layers", 1) or 1
        if n_layers != 1:
            raise EdgevlError(f"the MTP reference has one layer; the config asks for {n_layers} "
                              "(mtp_num_hidden_layers)")
        Norm, Layer, Rotary = _classes(moe)
        cfg = copy.deepcopy(text_config)   # one full-attention layer, index 0
        cfg.num_hidden_layers = 1
        cfg.layer_types = ["full_attention"]
        cfg._attn_implementation = getattr(text_config, "_attn_implementation", None) or "sdpa"
        if moe:
            cfg._experts_implementation = getattr(text_config, "_experts_implementation", None) or "eager"
        self.config, self.moe = cfg, moe
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = Norm(H, eps=eps)
        self.pre_fc_norm_hidden = Norm(H, eps=eps)
        self.layers = nn.ModuleList([Layer(cfg, 0)])
        self.norm = Norm(H, eps=eps)
        self.rotary_emb = Rotary(cfg)   # buffers only (not in the state dict)

    # ---- the block --------------------------------------------------------------------------

    def forward(self, inputs_embeds_shifted, hidden, position_ids):
        """Rows' outputs after ``mtp.norm``: [n, H] (or [B, n, H] for batched inputs).

        ``inputs_embeds_shifted`` [n, H]: row i's embedding of token i+1; ``hidden`` [n, H]: the
        main model's final normed hidden state at i; ``position_ids`` [3, n] (or [3, B, n]): token
        i's M-RoPE position (T, H, W). Row i attends to rows 0..i."""
        e, h = inputs_embeds_shifted, hidden
        single = e.dim() == 2
        if single:
            e, h = e[None], h[None]
        B, n, _ = e.shape
        pos = position_ids if position_ids.dim() == 3 else position_ids[:, None]
        pos = pos.expand(3, B, n)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(h)], dim=-1))
        mask = torch.full((n, n), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)[None, None]
        x = self.layers[0](x, position_embeddings=self.rotary_emb(x, pos), attention_mask=mask)
        x = self.norm(x)
        return x[0] if single else x

    @staticmethod
    def logits(normed, lm_head):
        """The main model's lm_head over the block's outputs: [n, V]."""
        return lm_head(normed)

    def recursive(self, inputs_embeds_shifted, hidden, position_ids, embed_tokens, lm_head, steps: int = 0):
        """(outputs [n + steps, H], logits [n + steps, V]): the n given rows, then ``steps`` rows
        each taking the embedding of the row before's argmax and that row's output.
        ``position_ids`` [3, n + steps] holds the recursive rows' positions too."""
        e, h = inputs_embeds_shifted, hidden
        n = e.shape[0]
        out = self(e, h, position_ids[:, :n])
        logits = self.logits(out, lm_head)
        for j in range(steps):
            token = logits[-1].argmax()
            e = torch.cat([e, embed_tokens(token[None]).to(e.dtype)])
            h = torch.cat([h, out[-1:]])
            out = self(e, h, position_ids[:, :n + j + 1])
            logits = torch.cat([logits, self.logits(out[-1:], lm_head)])
        return out, logits

    # ---- checkpoint names ---------------------------------------------------------------------

    def state_dict_for_checkpoint(self) -> dict:
        """{name on disk: tensor}: ``mtp.``-prefixed, the MoE experts one tensor per expert and
        projection as ``save_pretrained`` writes the main layers."""
        out = {}
        for k, v in self.state_dict().items():
            m = _FUSED_EXPERTS.match(k)
            if not m:
                out[PREFIX + k] = v.detach().clone().contiguous()
                continue
            for e in range(v.shape[0]):
                p = f"{PREFIX}{m.group(1)}.{e}"
                if m.group(2) == "gate_up_proj":
                    inter = v.shape[1] // 2
                    out[f"{p}.gate_proj.weight"] = v[e, :inter].detach().clone().contiguous()
                    out[f"{p}.up_proj.weight"] = v[e, inter:].detach().clone().contiguous()
                else:
                    out[f"{p}.down_proj.weight"] = v[e].detach().clone().contiguous()
        return out

    def load_checkpoint_tensors(self, tensors: dict, where: str = "the checkpoint"):
        """Load ``{name on disk: tensor}`` (only ``mtp.*`` names are read): every tensor of the block
        present with its shape, none left over; a one-line ``EdgevlError`` otherwise."""
        ours = {k[len(PREFIX):]: v for k, v in tensors.items() if k.startswith(PREFIX)}
        if not ours:
            raise EdgevlError(f"{where} has no MTP tensors ({PREFIX}*); make the tiny checkpoint with mtp=True")
        sd, experts = {}, {}
        for k, v in ours.items():
            m = _EXPERT.match(k)
            if m:
                experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = v
            else:
                sd[k] = v
        expected = self.state_dict()
        for base, parts in experts.items():
            gate_up, down = f"{base}.gate_up_proj", f"{base}.down_proj"
            if gate_up not in expected:
                sd.update({f"{base}.{e}.{p}.weight": v for (e, p), v in parts.items()})   # reported below
                continue
            E = expected[gate_up].shape[0]
            gone = [f"{PREFIX}{base}.{e}.{p}.weight" for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")
                    if (e, p) not in parts]
            extra = [f"{PREFIX}{base}.{e}.{p}.weight" for e, p in parts if e >= E]
            if gone or extra:
                what = f"lacks {gone[0]}" if gone else f"has an unused tensor {extra[0]}"
                raise EdgevlError(f"{where}: the MTP block {what} ({len(gone) + len(extra)} tensor(s) differ)")
            sd[gate_up] = torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(E)])
            sd[down] = torch.stack([parts[(e, "down_proj")] for e in range(E)])
        missing = sorted(set(expected) - set(sd))
        unused = sorted(set(sd) - set(expected))
        if missing:
            raise EdgevlError(f"{where}: the MTP block lacks {PREFIX}{missing[0]} "
                              f"({len(missing)} tensor(s) missing)")
        if unused:
            raise EdgevlError(f"{where}: unused MTP tensor {PREFIX}{unused[0]} ({len(unused)} tensor(s) not used: "
                              "the block has one full-attention layer)")
        for k, v in expected.items():
            if tuple(sd[k].shape) != tuple(v.shape):
                raise EdgevlError(f"{where}: MTP tensor {PREFIX}{k} has shape {list(sd[k].shape)}, "
                                  f"the config asks for {list(v.shape)}")
        self.load_state_dict({k: v.to(expected[k].dtype) for k, v in sd.items()}, strict=True)
        return self

    def load(self, folder):
        """Read the ``mtp.*`` tensors of a checkpoint folder (its safetensors files); strict."""
        folder = Path(folder)
        return self.load_checkpoint_tensors(read_mtp_tensors(folder), str(folder))


def read_mtp_tensors(folder) -> dict:
    """{name: tensor} of every ``mtp.*`` tensor in a checkpoint folder's safetensors files."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise EdgevlError(f"{folder}: no safetensors files")
    out = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for k in f.keys():
                if k.startswith(PREFIX):
                    out[k] = f.get_tensor(k)
    return out


def load_mtp(folder, text_config, dtype=None) -> Qwen3_5Mtp:
    """The checkpoint's MTP block for its (family's) text config, in eval mode."""
    block = Qwen3_5Mtp(text_config, is_moe(text_config))
    if dtype is not None:
        block = block.to(dtype)
    return block.load(folder).eval()


def init_random(block: Qwen3_5Mtp, seed: int, scale: float = 0.15) -> Qwen3_5Mtp:
    """Deterministic random weights in the style of the tiny checkpoints' (``tiny.init_random``):
    ``scale``·N(0, 1) matrices and zero-centred norm weights 0.1·N(0, 1) (gains 1 + w near one,
    none exactly one, so a wrong load shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(block.named_parameters()):
            p.copy_((0.1 if "norm" in name else scale) * torch.randn(p.shape, generator=g))
    return block


def count_speculative(tokens, prompt_len: int, draft, draft_tokens: int = 1, lengths=None) -> dict:
    """Greedy speculative decoding over a known greedy sequence ``tokens`` (prompt + generated):
    ``{"drafted": D, "accepted": A}``.

    The prefill yields ``tokens[prompt_len]``; then, with ``p`` the newest token not yet fed to the
    main model, ``draft(p, m)`` drafts m tokens for positions p+1 .. p+m (m = ``draft_tokens``, fewer
    where the sequence ends: a draft counts only if its target exists); the longest prefix equal to
    the sequence is accepted and the main model adds one more token, so p advances by accepted + 1.
    ``lengths``: a rule with ``length(k)`` (drafts for the next step, at most k) and ``update(drafted,
    accepted, tokens)``, e.g. edgevl's adaptive one, instead of always ``draft_tokens``.
    """
    n, p = len(tokens), prompt_len
    drafted = accepted = 0
    while p + 1 < n:
        m = min(lengths.length(draft_tokens) if lengths is not None else draft_tokens, n - 1 - p)
        d = list(draft(p, m))[:m]
        a = 0
        while a < m and int(d[a]) == int(tokens[p + 1 + a]):
            a += 1
        if lengths is not None:
            lengths.update(m, a, a + 1)
        drafted, accepted, p = drafted + m, accepted + a, p + a + 1
    return {"drafted": drafted, "accepted": accepted}


def extend_positions(position_ids, k: int):
    """[3, n] positions followed by k decode positions (the largest so far + 1, + 2, ... on all
    three axes)."""
    if k <= 0:
        return position_ids
    nxt = position_ids.max() + 1 + torch.arange(k, dtype=position_ids.dtype)
    return torch.cat([position_ids, nxt[None].expand(3, k)], dim=1)
