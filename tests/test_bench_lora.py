"""bench/lora.py in a tiny configuration: two real `diffq run --compile regional` runs
(2 adapters in whole batches, and one adapter), read back from their records: every
batch one adapter, a swap at each change of adapter and none elsewhere, no graph after
the first batch; the section and the goal row it renders."""

from __future__ import annotations

from bench import lora


def test_the_lora_bench_runs_and_reads_swaps_from_the_records():
    result = lora.main(["--items", "8", "--adapters", "2", "--batch", "2", "--size", "32", "--steps", "1",
                        "--rank", "4", "--repeats", "1"])
    (many,), (one,) = result["runs"]["many"], result["runs"]["one"]
    assert many["images"] == one["images"] == 8 and many["batches"] == one["batches"] == 4
    # Batches in order a0 a0 a1 a1 against a0 a0 a0 a0: a swap at each change, the first batch's included.
    assert (many["adapter_changes"], many["swaps"]) == (2, 2) and (one["adapter_changes"], one["swaps"]) == (1, 1)
    assert many["swap_s_total"] > 0 and one["swap_s_total"] == 0  # after the first batch
    assert many["graphs_after_first"] == one["graphs_after_first"] == 0
    assert result["ratio"] == round(many["images_per_s"] / one["images_per_s"], 3)
    lines = lora.render(result)
    assert lines[0] == "## LoRA adapters per row" and sum(line.startswith("| 1 |") for line in lines) == 1
    what, met, figure = lora.goal(result)
    assert "8 items over 2 adapters" in what and met == (result["ratio"] >= lora.GOAL)
    assert figure.startswith(f"{result['ratio']:.3f}")
    assert lora.goal(None)[1] == "pending"
