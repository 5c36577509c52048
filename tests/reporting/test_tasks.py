"""The report's downstream scores (trainer.reporting.tasks): intervals and differences against textbook
values."""

from __future__ import annotations

import pytest

from trainer.reporting.runs import Run
from trainer.reporting.tasks import differ, resolvable, task_rows, task_verdicts, wilson


@pytest.mark.parametrize("hits, n, low, high", [(0, 10, 0.0, 0.2775), (8, 10, 0.4902, 0.9433),
                                                 (620, 1000, 0.5895, 0.6496), (10, 10, 0.7225, 1.0)])
def test_the_interval_is_wilsons(hits, n, low, high):
    """Wilson's score interval at 95 %, as tabulated (Newcombe 1998; e.g. 8 of 10: 0.490-0.943), not the
    normal approximation (which gives 0.552-1.048 for 8 of 10, and a width of 0 at 0 of 10)."""
    got = wilson(hits / n, n)
    assert got == pytest.approx((low, high), abs=5e-4)


def test_arms_differ_beyond_noise_only_past_what_the_items_resolve():
    assert not differ({"acc": 0.62, "n": 1000}, {"acc": 0.60, "n": 1000})
    assert differ({"acc": 0.66, "n": 1000}, {"acc": 0.60, "n": 1000})
    assert resolvable(0.5, 1000) == pytest.approx(0.0438, abs=1e-4)  # 1,000 items: ~4.4 points, not 1
    assert resolvable(0.5, 100_000) == pytest.approx(0.00438, abs=1e-5)


def run_with(name: str, acc: float, n: int = 1000) -> Run:
    line = {"step": 10, "loss": 1.0,
            "tasks": {"arc": {"n": n, "acc": acc, "acc_norm": acc, "bits_per_byte": 1.5}}}
    return Run(name=name, path=None, config={}, metrics=[{"step": 5, "loss": 2.0}, line], summary=None,
               notes=[])


def test_rows_and_verdicts_name_each_arm_its_interval_and_the_resolution():
    ref, close, far = run_with("packed", 0.60), run_with("unpacked", 0.62), run_with("no_isolation", 0.66)
    rows = task_rows([ref, close, far], ref)
    assert [r[:4] for r in rows] == [["packed", "arc", "10", "1000"], ["unpacked", "arc", "10", "1000"],
                                     ["no_isolation", "arc", "10", "1000"]]
    assert rows[1][4] == "0.620 [0.590, 0.650]" and rows[1][-1] == "+2.0 points" and rows[0][-1] == ""
    verdicts = dict(task_verdicts([ref, close, far], ref))
    assert "Δ +2.0 points, within noise" in verdicts["unpacked arc"]
    assert "Δ +6.0 points, beyond noise" in verdicts["no_isolation arc"]
    assert "1000 items resolve differences of about 4.3 points" in verdicts["unpacked arc"]


def test_the_long_document_table_gives_each_layouts_shares():
    """The packing papers' ratios from summary.json's packing_stats: split and truncation shares of documents,
    cut tokens and tokens trained without their start as shares of the tokens in; runs that met no long
    document give no row."""
    from trainer.reporting.tables import long_doc_rows

    def run(name, policy, **stats):
        return Run(name=name, path=None, config={"packing.long_docs": policy}, metrics=[],
                   summary={"packing_stats": {"docs_in": 100, "tokens_in": 10_000, **stats}}, notes=[])

    runs = [run("split", "split", docs_split=4, chunks_from_splits=10, tokens_without_start=1_200),
            run("truncate", "truncate", docs_truncated=4, tokens_truncated=1_200),
            run("short docs", "split")]
    assert long_doc_rows(runs) == [
        ["split", "split", "100", "4.0%", "0.0%", "0.0%", "0.0%", "12.0%"],
        ["truncate", "truncate", "100", "0.0%", "4.0%", "0.0%", "12.0%", "n/a"],
    ]
