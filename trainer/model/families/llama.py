"""LlamaForCausalLM: RMSNorm, SwiGLU MLP, rotary positions (theta and scaling from the config), grouped-query
attention, tied or untied head, biases everywhere or nowhere. Its config reading and tensor names are shared
by the Llama-shaped families (qwen2, mistral), which subclass `Llama`.

Llama's q and k are already in the rotate-half layout packtrain's RoPE uses (transformers' conversion script
permuted Meta's), so nothing is permuted; q, k and v are rows of `attn.c_attn`, gate and up rows of
`mlp.c_fc`.
"""

from __future__ import annotations

from trainer.model.families.family import HEAD, Family, Piece, refuse_variants, required
from trainer.model.gpt import GPTConfig


class Llama(Family):
    model_type, hf_class = "llama", "LlamaForCausalLM"

    def computes(self, cfg: GPTConfig) -> bool:
        qkv_bias = cfg.bias if cfg.qkv_bias is None else cfg.qkv_bias
        return (cfg.pos_emb, cfg.norm, cfg.mlp) == ("rope", "rmsnorm", "swiglu") and qkv_bias == cfg.bias

    def hf_config(self, cfg: GPTConfig) -> dict:
        return {**self.llama_fields(cfg), "attention_bias": cfg.bias, "mlp_bias": cfg.bias}

    def llama_fields(self, cfg: GPTConfig) -> dict:
        """The config.json fields every Llama-shaped class reads."""
        scaling = dict(cfg.rope_scaling or {})
        rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
        return {
            "hidden_size": cfg.n_embd,
            "intermediate_size": cfg.hidden,
            "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps,
            # transformers 5 reads rope_parameters, 4.x rope_theta and rope_scaling: both, the same numbers.
            "rope_theta": cfg.rope_theta,
            "rope_scaling": {"rope_type": rope_type, **scaling} if rope_type != "default" else None,
            "rope_parameters": {"rope_type": rope_type, "rope_theta": cfg.rope_theta, **scaling},
            "attention_dropout": 0.0,
        }

    def variants(self, config: dict) -> dict:
        """{key: (value, the values packtrain computes)} of this class's config (`refuse_variants`)."""
        n_embd, n_head = config["hidden_size"], config["num_attention_heads"]
        return {
            "hidden_act": (config.get("hidden_act", "silu"), ("silu",)),
            "head_dim": (config.get("head_dim", n_embd // n_head), (n_embd // n_head,)),
            "attention_dropout": (config.get("attention_dropout", 0.0), (0, 0.0)),
            "use_sliding_window": (config.get("use_sliding_window", False), (False,)),
            "layer_types": (sorted(set(config.get("layer_types") or ["full_attention"])),
                            (["full_attention"],)),
            # Llama's biases: q, k, v and o together, the MLP's together; packtrain has one switch for both.
            "mlp_bias": (config.get("mlp_bias", False), (config.get("attention_bias", False),)),
        }

    def biases(self, config: dict) -> dict:
        """GPTConfig's bias and qkv_bias for this class's config."""
        return {"bias": bool(config.get("attention_bias", False)), "qkv_bias": None}

    def config_from_hf(self, config: dict) -> GPTConfig:
        required(config, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads"),
                 ("num_key_value_heads", "head_dim", "max_position_embeddings"))
        refuse_variants(config, self.variants(config))
        rope = dict(config.get("rope_parameters") or {})  # transformers 5: theta and scaling in one dict
        theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
        scaling = (rope if rope.get("rope_type", rope.get("type", "default")) != "default"
                   else config.get("rope_scaling"))
        return GPTConfig(
            vocab_size=config["vocab_size"], n_layer=config["num_hidden_layers"],
            n_head=config["num_attention_heads"], n_embd=config["hidden_size"],
            n_kv_head=config.get("num_key_value_heads") or config["num_attention_heads"],
            mlp_hidden=config["intermediate_size"], max_seq_len=config.get("max_position_embeddings", 2048),
            **self.biases(config), pos_emb="rope", rope_theta=float(theta),
            rope_scaling=dict(scaling) if scaling else None, norm="rmsnorm",
            norm_eps=float(config.get("rms_norm_eps", 1e-6)), mlp="swiglu",
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            init_std=float(config.get("initializer_range", 0.02)), family=self.model_type)

    def pieces(self, cfg: GPTConfig) -> list[Piece]:
        """Example (n_head 4, n_kv_head 2, head_dim 8): Piece("model.layers.0.self_attn.k_proj.weight",
        "blocks.0.attn.c_attn.weight", rows=(32, 48))."""
        H, KV, inner = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.hidden  # q rows, k/v, gate
        qkv_bias = cfg.bias if cfg.qkv_bias is None else cfg.qkv_bias
        out = [Piece("model.embed_tokens.weight", "wte.weight")]
        for i in range(cfg.n_layer):
            hf, ours = f"model.layers.{i}.", f"blocks.{i}."
            out.append(Piece(hf + "input_layernorm.weight", ours + "ln_1.weight"))
            for suffix in ("weight", "bias") if qkv_bias else ("weight",):
                for proj, rows in (("q", (0, H)), ("k", (H, H + KV)), ("v", (H + KV, H + 2 * KV))):
                    out.append(Piece(f"{hf}self_attn.{proj}_proj.{suffix}", f"{ours}attn.c_attn.{suffix}",
                                     rows))
            for suffix in ("weight", "bias") if cfg.bias else ("weight",):
                out.append(Piece(f"{hf}self_attn.o_proj.{suffix}", f"{ours}attn.c_proj.{suffix}"))
                out.append(Piece(f"{hf}mlp.gate_proj.{suffix}", f"{ours}mlp.c_fc.{suffix}", (0, inner)))
                out.append(Piece(f"{hf}mlp.up_proj.{suffix}", f"{ours}mlp.c_fc.{suffix}", (inner, 2 * inner)))
                out.append(Piece(f"{hf}mlp.down_proj.{suffix}", f"{ours}mlp.c_proj.{suffix}"))
            out.append(Piece(hf + "post_attention_layernorm.weight", ours + "ln_2.weight"))
        out.append(Piece("model.norm.weight", "ln_f.weight"))
        if not cfg.tie_embeddings:
            out.append(Piece("lm_head.weight", HEAD))
        return out


FAMILY = Llama()
