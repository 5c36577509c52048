"""GPT2LMHeadModel: LayerNorm, GELU (tanh) MLP, learned positions, biases, multi-head attention, tied head.

GPT-2's Conv1D stores W as (in, out), nn.Linear as (out, in): every projection is transposed
(`Piece.transpose`).
"""

from __future__ import annotations

from trainer.model.families.family import Family, Piece, refuse_variants, required
from trainer.model.gpt import GPTConfig

ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
"""transformers' names for the tanh approximation of GELU (F.gelu(approximate='tanh')); the first is
written."""


class GPT2(Family):
    model_type, hf_class = "gpt2", "GPT2LMHeadModel"

    def computes(self, cfg: GPTConfig) -> bool:
        qkv_bias = cfg.bias if cfg.qkv_bias is None else cfg.qkv_bias
        return ((cfg.pos_emb, cfg.norm, cfg.mlp) == ("learned", "layernorm", "gelu") and cfg.tie_embeddings
                and cfg.kv_heads == cfg.n_head and qkv_bias == cfg.bias
                and cfg.mlp_hidden in (None, 4 * cfg.n_embd))

    def hf_config(self, cfg: GPTConfig) -> dict:
        return {
            "n_positions": cfg.max_seq_len,
            "n_embd": cfg.n_embd,
            "n_layer": cfg.n_layer,
            "n_head": cfg.n_head,
            "n_inner": None,  # 4 * n_embd, as in packtrain's MLP
            "activation_function": ACTIVATIONS[0],
            "layer_norm_epsilon": cfg.norm_eps,
            "embd_pdrop": cfg.dropout,
            "resid_pdrop": cfg.dropout,
            "attn_pdrop": 0.0,  # packtrain has no dropout inside attention
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }

    def config_from_hf(self, config: dict) -> GPTConfig:
        required(config, ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"), ("n_inner",))
        n_embd = config["n_embd"]
        refuse_variants(config, {
            "activation_function": (config.get("activation_function", ACTIVATIONS[0]), ACTIVATIONS),
            "n_inner": (config.get("n_inner"), (None, 4 * n_embd)),
            "scale_attn_weights": (config.get("scale_attn_weights", True), (True,)),
            "scale_attn_by_inverse_layer_idx": (config.get("scale_attn_by_inverse_layer_idx", False),
                                                (False,)),
            "add_cross_attention": (config.get("add_cross_attention", False), (False,)),
        })
        return GPTConfig(vocab_size=config["vocab_size"], n_layer=config["n_layer"], n_head=config["n_head"],
                         n_embd=n_embd, max_seq_len=config["n_positions"], bias=True, pos_emb="learned",
                         norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
                         init_std=float(config.get("initializer_range", 0.02)), family=self.model_type)

    def pieces(self, cfg: GPTConfig) -> list[Piece]:
        """GPT-2 always has biases: a bias-free packtrain model's are exported as zeros
        (trainer.checkpoint.hf)."""
        out = [Piece("transformer.wte.weight", "wte.weight"), Piece("transformer.wpe.weight", "wpe.weight")]
        for i in range(cfg.n_layer):
            hf, ours = f"transformer.h.{i}.", f"blocks.{i}."
            for module in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
                conv1d = not module.startswith("ln")
                out.append(Piece(f"{hf}{module}.weight", f"{ours}{module}.weight", transpose=conv1d))
                out.append(Piece(f"{hf}{module}.bias", f"{ours}{module}.bias"))
        return out + [Piece("transformer.ln_f.weight", "ln_f.weight"),
                      Piece("transformer.ln_f.bias", "ln_f.bias")]


FAMILY = GPT2()
