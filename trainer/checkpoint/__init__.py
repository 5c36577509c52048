"""Checkpoints: the one owner of what a checkpoint directory holds and how it is read back without running code.

    store      save/load/latest/prune of `<run dir>/checkpoints/step_NNNNNN/` and the names of every file in
               it (meta.json, engine.pt, model.safetensors, rank_NNNNN.pt, conventions.json, tokenizer/)
    safe_io    plain-data + tensor files written by torch.save and read with weights_only=True
    weights    a checkpoint's model alone (shape, safetensors weights, tokenizer): init_from, export, generate
    hf         the mapping to and from a GPT-2 Hugging Face directory

Must not import: the run or config modules, or any command (it may import distributed, model and data).
"""
