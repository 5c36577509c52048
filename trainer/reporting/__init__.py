"""Reporting: compare training runs from the files they wrote (`python -m trainer.report`, a thin command).

    runs        a run dir read (config.json, metrics.jsonl, summary.json), a run's numbers, the
                configs' differences
    verdicts    a run against the reference: same objective, layout-dependent, ablation, not comparable
    tables      one line per run; loss by document length and by source; a mixture's shares; FLOPs both ways
    tasks       downstream scores per arm: accuracy with a 95 % interval, differences beyond noise, the plot
    plots       the PNGs (matplotlib, Agg), the corpora's document lengths from their manifests
    html        report.md and a self-contained report.html (`make_report`)

Reads only files: what each key means comes from trainer.registry, manifests through trainer.data.shards.
Must not import: torch, the model, distributed, checkpoint, run or config modules (a report runs where no GPU
or training stack is installed).
"""
