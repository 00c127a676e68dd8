"""A model folder from S3 into the node-local cache: diffq's fetch against what a user
would write, on the same loopback moto server, in one run.

The folder is the tiny pipeline plus padding safetensors shards of random bytes
(--size-gb in all, --shard-mb each), uploaded as --upload says: by default one PUT per
file with a CRC64NVME checksum, the one S3 keeps of every object uploaded without a
checksum of its own (the path real objects take). Three fetches of it, each into an
empty folder:

  diffq       worker/device/model_fetch.py `fetch`: every file in ranged pieces of
              PART_BYTES (or its upload's parts where the check is over parts), as many
              streams side by side as pay, each piece hashed as it is written and its
              digest recorded; the file's checksum from the pieces' (CRCs combined), then
              renamed into place
  tuned       boto3 `download_file` per file, one file after another, with a tuned
              TransferConfig (the same threads and part size as diffq's)
  sequential  one `get_object` stream per file, one file after another

Goal: diffq ≥ 0.9 × the best anchor's MB/s. On loopback the emulator (one Python
process) is the bottleneck of all three, which is why only the ratio counts.

    python bench/model_fetch.py [--size-gb 1.0] [--shard-mb 256] [--threads 16] [--part-mb 64,256]

--part-mb sets the tuned anchor's threshold and part size, and diffq's PART_BYTES.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = 2**20


def make_folder(folder: Path, size_bytes: int, shard_bytes: int) -> None:
    from diffq.app.tiny import build_tiny_pipeline

    build_tiny_pipeline(folder)
    header = json.dumps({"__metadata__": {"padding": "bench"}}).encode()
    header += b" " * (-len(header) % 8)
    left, n = size_bytes, 0
    while left > 0:
        size = min(shard_bytes, left)
        with (folder / "transformer" / f"padding-{n:05d}.safetensors").open("wb") as f:
            f.write(len(header).to_bytes(8, "little") + header)
            body = max(0, size - 8 - len(header))
            while body:
                chunk = min(body, 16 * MiB)
                f.write(os.urandom(chunk))
                body -= chunk
        left -= size
        n += 1


def files_of(folder: Path) -> list[tuple[str, Path]]:
    return [(p.relative_to(folder).as_posix(), p) for p in sorted(folder.rglob("*")) if p.is_file()]


def timed(name: str, total: int, call) -> dict:
    started = time.perf_counter()
    call()
    seconds = time.perf_counter() - started
    row = {"name": name, "seconds": round(seconds, 2), "mb_per_s": round(total / 1e6 / seconds, 1)}
    print(f"  {name:<11} {row['seconds']:>7.2f} s  {row['mb_per_s']:>7.1f} MB/s", flush=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="padding shards in all (GB)")
    parser.add_argument("--shard-mb", type=int, default=256, help="size of each padding shard (MiB)")
    parser.add_argument("--threads", type=int, default=16, help="DIFFQ_MODEL_FETCH_THREADS and the tuned anchor's")
    parser.add_argument("--part-mb", default="",
                        help="comma-separated part sizes (MiB) for diffq and the tuned anchor, each a round on "
                             "the same server and upload; default diffq's PART_BYTES")
    parser.add_argument("--upload", choices=("crc64nvme", "parts", "whole"), default="crc64nvme",
                        help="crc64nvme: one PUT per file with a CRC64NVME checksum (what S3 keeps of objects "
                             "uploaded without one); parts: 8 MiB multipart uploads (boto3 stores a composite "
                             "CRC32, over the parts' CRC32s); whole: one PUT per file (a full-object CRC32)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of the three per part size, the order rotated each time; medians shown")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    import boto3
    from boto3.s3.transfer import TransferConfig

    from diffq.core.settings import Settings
    from diffq.worker.device import model_fetch
    from diffq.testing.servers import S3Server

    parts = [int(mb) * MiB for mb in args.part_mb.split(",") if mb] or [model_fetch.PART_BYTES]
    rounds = []
    load_before = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="diffq-bench-fetch-") as tmp:
        root = Path(tmp)
        folder = root / "model"
        make_folder(folder, int(args.size_gb * 1e9), args.shard_mb * MiB)
        files = files_of(folder)
        total = sum(p.stat().st_size for _, p in files)
        with S3Server(root / "moto") as server:
            os.environ.update(AWS_ENDPOINT_URL=server.endpoint, AWS_ACCESS_KEY_ID="bench",
                              AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
            bucket = server.make_bucket("bench-models")
            client = boto3.session.Session().client("s3", endpoint_url=server.endpoint)
            upload = TransferConfig(multipart_chunksize=8 * MiB, max_concurrency=args.threads)
            for key, path in files:
                if args.upload == "parts":
                    client.upload_file(str(path), bucket, f"m/{key}", Config=upload)
                else:
                    with path.open("rb") as body:
                        client.put_object(Bucket=bucket, Key=f"m/{key}", Body=body,
                                          ChecksumAlgorithm="CRC64NVME" if args.upload == "crc64nvme" else "CRC32")
            shutil.rmtree(folder)
            url = f"s3://{bucket}/m"
            print(f"{len(files)} files, {total / 1e9:.2f} GB from moto on loopback, {args.threads} threads, "
                  f"{os.cpu_count()} CPUs", flush=True)
            for part in parts:
                model_fetch.PART_BYTES = part
                print(f" {part // MiB} MiB parts", flush=True)
                tuned = TransferConfig(max_concurrency=args.threads, multipart_threshold=part,
                                       multipart_chunksize=part, io_chunksize=MiB)
                out = root / f"round-{part}"

                def diffq_fetch():
                    fetched = model_fetch.fetch(url, settings=Settings(model_cache=str(out / "cache"),
                                                                       model_fetch_threads=args.threads))
                    assert not fetched.hit and fetched.bytes == total

                def download_file_each():
                    for key, _ in files:
                        target = out / "tuned" / key
                        target.parent.mkdir(parents=True, exist_ok=True)
                        client.download_file(bucket, f"m/{key}", str(target), Config=tuned)

                def sequential():
                    for key, _ in files:
                        target = out / "sequential" / key
                        target.parent.mkdir(parents=True, exist_ok=True)
                        body = client.get_object(Bucket=bucket, Key=f"m/{key}")["Body"]
                        with target.open("wb") as f:
                            shutil.copyfileobj(body, f, MiB)

                # The order rotated each repeat: who goes first finds the server's caches cold.
                ways = [("diffq", diffq_fetch), ("tuned", download_file_each), ("sequential", sequential)]
                seconds: dict[str, list[float]] = {name: [] for name, _ in ways}
                for repeat in range(args.repeats):
                    for name, call in ways[repeat % 3:] + ways[: repeat % 3]:
                        seconds[name].append(timed(name, total, call)["seconds"])
                        shutil.rmtree(out)
                rows = [{"name": name, "seconds": statistics.median(values), "repeats": values,
                         "mb_per_s": round(total / 1e6 / statistics.median(values), 1)}
                        for name, values in seconds.items()]
                best = max(rows[1:], key=lambda r: r["mb_per_s"])
                ratio = rows[0]["mb_per_s"] / best["mb_per_s"]
                print(f"  diffq / best anchor ({best['name']}): {ratio:.2f}  (goal ≥ 0.9)", flush=True)
                rounds.append({"part_mib": part // MiB, "rows": rows, "ratio": round(ratio, 3), "best": best["name"]})
    result = {"bytes": total, "files": len(files), "threads": args.threads, "shard_mib": args.shard_mb,
              "upload": args.upload, "pieces": True,
              "load_average": [load_before, round(os.getloadavg()[0], 2)],
              "cpus": os.cpu_count(), "rounds": rounds,
              "command": "python bench/model_fetch.py " + " ".join(
                  a for a in (argv if argv is not None else sys.argv[1:]) if a != "--json" and a != str(args.json))}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


def render(result: dict | None) -> list[str]:
    """The docs/BENCHMARKS.md section (bench/__main__.py)."""
    if not result:
        return []
    lines = ["## A model from object storage into the node cache", "",
             f"`{result['command'].strip()}`: {result['files']} files, {result['bytes'] / 1e9:.2f} GB (the tiny "
             f"pipeline and {result['shard_mib']} MiB padding shards, uploaded "
             + (("in 8 MiB parts: checked by the stored composite CRC32" if result.get("whole_mib")
                 or result.get("pieces") else "in 8 MiB parts: checked by the multipart ETag rule, MD5")
                if result.get("upload", "parts") == "parts" else
                "one PUT per file: checked by the stored CRC64NVME, the checksum S3 keeps of objects uploaded without "
                "one" if result.get("upload") == "crc64nvme" else "one PUT per file: checked by the stored CRC32")
             + ") from moto on "
             f"loopback, {result['threads']} threads, {result['cpus']} cores"
             + (f" (load average {result['load_average'][0]} → {result['load_average'][1]})"
                if result.get("load_average") else "") + ", each fetch into an empty folder. "
             + ("diffq: `worker/device/model_fetch.py` (every file in ranged pieces of the round's part size, "
                "as many streams side by side as pay, each piece hashed as it is written and recorded for a resume; "
                "the file's checksum made from the pieces' digests, then renamed into place)"
                if result.get("pieces") else
                "diffq: `worker/device/model_fetch.py` (files up to "
                f"{result.get('whole_mib')} MiB one GET each, checked against the store's checksum as the bytes are "
                "written, as many streams side by side as pay; bigger files in ranged parts by boto3's transfer "
                "manager, checked after; each renamed into place once checked)"
                if result.get("whole_mib") else
                "diffq: `worker/device/model_fetch.py` (one transfer manager for every file and part, each file checked "
                "against its ETag or stored checksum before its rename)")
             + "; tuned: boto3 `download_file` per file with the TransferConfig of the round (the part size as "
             f"threshold and part, {result['threads']} threads); sequential: one `get_object` stream per file.", "",
             "| part MiB | diffq MB/s | tuned MB/s | sequential MB/s | diffq / best anchor |", "|---|---|---|---|---|"]
    for one in result["rounds"]:
        rate = {row["name"]: row["mb_per_s"] for row in one["rows"]}
        lines.append(f"| {one['part_mib']} | {rate['diffq']} | {rate['tuned']} | {rate['sequential']} | "
                     f"**{one['ratio']:.2f}** ({one['best']}) |")
    return lines + [""]


if __name__ == "__main__":
    main()
