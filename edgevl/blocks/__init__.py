"""Shared blocks: the pieces several model families compose, each a public kernel.

``base`` (the weight context, config parsing, the language-model head and embedding writer),
``rope`` (1-D RoPE and M-RoPE tables and positions), ``mla`` (multi-head latent attention),
``gated_delta`` (the delta-rule cores: Gated DeltaNet and KDA), ``moe`` (routing, the expert
writer and store), ``vision`` (vision-transformer pieces), ``qwen_vision`` (Qwen3-VL's vision
tower) and ``vocabulary`` (the option and benchmark-profile types blocks and families both
declare). Families live in ``edgevl/models/<family>/`` and import these; blocks never import
anything under ``edgevl/models``.
"""
