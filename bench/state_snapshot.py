"""What the typed data state costs the prefetch thread per step (issue 31): RowStream.state(), the snapshot
the prefetch thread takes before each draw, against the dicts the old state_dict built (slot states only), and
the checkpoint's dict. Needs data/demo (make demo, or python -m trainer.prepare --source demo --out
data/demo).

    OMP_NUM_THREADS=1 python bench/state_snapshot.py
"""

from __future__ import annotations

import time

from trainer.data.config import DataConfig, PackingConfig
from trainer.data.feed import build_data


def per_call_ms(f, n: int = 200) -> float:
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    rows = build_data(DataConfig(path="data/demo", num_workers=2, prefetch=False), PackingConfig(),
                      512, 0, 0, 1).rows
    try:
        for _ in range(20):
            rows.take(32)
        loader = rows.docs
        snapshot = per_call_ms(rows.state)
        old = per_call_ms(lambda: {s: st.to_dict() for s, st in loader.slot_states.items()})
        checkpoint = per_call_ms(lambda: rows.state().to_dict())
        buffers = [len(s.position.buffer) for s in loader.slot_states.values() if s.position]
        print(f"slots {len(loader.slot_states)}, buffers {buffers}: typed snapshot {snapshot:.3f} ms, "
              f"old slot dicts {old:.3f} ms, checkpoint dict {checkpoint:.3f} ms")
    finally:
        rows.close()


if __name__ == "__main__":
    main()
