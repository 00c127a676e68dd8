"""A dataset pipeline with the Python API, notebook style (each `# %%` is a cell).

Runs offline on a CPU in about half a minute:

    python examples/dataset_pipeline.py [WORKDIR]

For a fleet, replace the `api.run` cell with `api.submit(..., broker_url=...)` and
point OUT at s3://… or gs://…; every later cell is unchanged.
"""

# %% Setup: a tiny offline pipeline and a prompt file.
import sys
import tempfile
from pathlib import Path

from diffq import api
from diffq.app.tiny import build_tiny_pipeline


def main(workdir: Path) -> None:
    model = str(build_tiny_pipeline(workdir / "tiny"))
    prompts = Path(__file__).with_name("prompts.jsonl")
    out = str(workdir / "run")

    # %% Generate. --seed-base makes a rerun reproduce the same images.
    result = api.run(prompts, out, model=model, workers=1, batch_size=4, steps=2, seed_base="demo", progress=False)
    print(f"{result.done}/{result.total} images, {result.images_per_s:.1f} images/s")

    # %% Follow progress (here the run is already done). api.watch(out) shows a live view.
    print(api.status(out).to_json())

    # %% Export as WebDataset shards and as Parquet; a bucket URL works as DEST too.
    shards = api.export(out, workdir / "wds", format="webdataset", shard_size=16)
    table = api.export(out, workdir / "parquet", format="parquet", shard_size=1000)
    print(shards.files, table.files)

    # %% Read them back with the usual libraries.
    import webdataset as wds

    first = next(iter(wds.WebDataset(str(workdir / "wds/shard-000000.tar"), shardshuffle=False).decode("pil")))
    print(first["json"]["prompt"], first["png"].size)

    import datasets

    ds = datasets.load_dataset("parquet", data_files=str(workdir / "parquet/*.parquet"), split="train")
    print(ds)

    # %% Report: text, an HTML page with plots and a contact sheet, cost per 1,000 images.
    report = api.report(out, html_path=workdir / "report.html", price_per_device_hour=0.5)
    print(api.render_text(report))
    print(f"open {workdir / 'report.html'}")


if __name__ == "__main__":  # spawned worker processes re-import this module
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="diffq-example-")))
