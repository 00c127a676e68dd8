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


def test_the_modes_path_interleaves_each_mode_with_the_bare_rows_and_renders_its_table(monkeypatch, tmp_path):
    """`--modes swap,fuse` on a small result (each `diffq run` stood in by its figures):
    per repeat every mode and the rows without adapters, the order turned each repeat;
    s/image with over without per repeat, the set change's median, graphs after the
    first batch; one table row per run kind."""
    from types import SimpleNamespace

    calls = []
    rate = {"none": 100.0, "swap": 80.0, "fuse": 95.0}

    def diffq_run(model, rows, root, args, lora_mode=None):
        name = lora_mode or "none"
        calls.append(name)
        assert all(("lora" in row) == (lora_mode is not None) for row in rows) and len(rows) == args.items
        k = sum(1 for c in calls if c == name)  # the repeat
        return {"images_per_s": rate[name] + k, "swap_s_median": {"none": 0.0, "swap": 0.004, "fuse": 0.001}[name] * k,
                "graphs_after_first": 0}

    monkeypatch.setattr(lora, "diffq_run", diffq_run)
    args = SimpleNamespace(modes="swap,fuse", ranks="4,8", items=8, adapters=2, batch=2, size=32, steps=1, repeats=3,
                           compile="regional")
    result = lora.modes_bench("model", ["a0", "a1"], tmp_path, args)
    assert calls == ["none", "swap", "fuse", "fuse", "swap", "none", "none", "swap", "fuse"]
    assert result["over_none"]["swap"] == [round((1 / 81) / (1 / 101), 3), round((1 / 82) / (1 / 102), 3),
                                           round((1 / 83) / (1 / 103), 3)]
    assert result["s_per_image"]["fuse"] == round(1 / 97, 5) and result["change_s_median"] == {"swap": 0.008,
                                                                                               "fuse": 0.002}
    lines = lora.render_modes(result)
    assert lines[0].startswith("`python -m bench.lora --modes swap,fuse --ranks 4,8 --items 8 --adapters 2")
    rows = {line.split(" | ")[0]: line for line in lines if line.startswith("| ")}
    assert set(rows) == {"| mode", "| none", "| swap", "| fuse"}
    assert rows["| swap"].endswith(f"| {', '.join(f'{r:.3f}' for r in result['over_none']['swap'])} | 0.0080 | 0 |")
    assert rows["| none"].endswith("| — | — | 0 |")
