"""Checkpoints: the one owner of what a checkpoint directory holds and how it is read back without running
code.

    store      the layout of a checkpoint directory (every file name in it, and the tied head left out of its
               weights: its docstring is the one description) and the collective save/load/latest/prune;
               engines hand it their state, and it does all the file I/O but DeepSpeed's own shards
    streams    a resumed run's data streams: each data rank's state from the checkpoint's typed `Record`, its
               own on the writer's shape, dealt from every written stream on another (trainer.data.reshape)
    safe_io    plain-data + tensor files written by torch.save and read with weights_only=True
    weights    a checkpoint's model alone (shape, safetensors weights, tokenizer): init_from, export, generate
    integrity  confinement (a checkpoint reads nothing outside itself) and the sha256 of every file it holds
    tensors    tensors read from elsewhere checked before use: finite, and as many as their config says
    hf         Hugging Face model directories both ways, applying the families' declarations
               (trainer.model.families: config, names); streamed safetensors

Must not import: the run or config modules, or any command (it may import distributed, model and data).
"""
