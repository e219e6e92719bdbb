"""One-shot: upload a folder to an S3-compatible store (the compose demo's MinIO).

    python docker/upload.py /data/shapes s3://stoker-demo/shapes --endpoint http://minio:9000

Creates the bucket if missing; uploads every file under the folder, keys relative to it,
skipping objects already there with the same size (a rerun uploads nothing). Credentials
come from boto3's usual chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in compose).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import boto3
from botocore.exceptions import ClientError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("url", help="s3://bucket/prefix")
    ap.add_argument("--endpoint", help="http://host:port of an S3-compatible store")
    args = ap.parse_args(argv)
    if not args.url.startswith("s3://"):
        ap.error(f"url must be s3://bucket/prefix, got {args.url!r}")
    bucket, _, prefix = args.url[5:].partition("/")
    s3 = boto3.client("s3", endpoint_url=args.endpoint, region_name="us-east-1")
    try:
        s3.head_bucket(Bucket=bucket)
    except ClientError:
        s3.create_bucket(Bucket=bucket)
    have = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        have.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    sent = 0
    for path in sorted(p for p in args.folder.rglob("*") if p.is_file()):
        key = f"{prefix.rstrip('/')}/{path.relative_to(args.folder).as_posix()}".lstrip("/")
        if have.get(key) != path.stat().st_size:
            s3.upload_file(str(path), bucket, key)
            sent += 1
    print(f"{args.url}: uploaded {sent} files, {len(have)} were there already")
    return 0


if __name__ == "__main__":
    sys.exit(main())
