"""An S3 endpoint for tests: moto's server on a free local port, in this process, with the ``AWS_*``
variables s3fs/botocore read pointing at it (processes started meanwhile, Ray's workers and spawned ranks,
inherit them)."""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Iterator

import pytest

ENV_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL",
             "AWS_MAX_ATTEMPTS")  # fmt: skip


@contextlib.contextmanager
def aws_env(**values: str) -> Iterator[None]:
    """Set these ``AWS_*`` variables (the others of :data:`ENV_NAMES` unset), restored after; s3fs's cached
    filesystems (which hold the old endpoint) are dropped both times."""
    s3fs = pytest.importorskip("s3fs", reason="the test extra installs s3fs")
    old = {k: os.environ.pop(k, None) for k in ENV_NAMES}
    os.environ.update(values)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield
    finally:
        for k in ENV_NAMES:
            os.environ.pop(k, None)
        os.environ.update({k: v for k, v in old.items() if v is not None})
        s3fs.S3FileSystem.clear_instance_cache()


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """``s3://<bucket>``, a new empty bucket, on a moto S3 server of its own (moto keeps its buckets per
    process, so each call makes one of another name)."""
    moto_server = pytest.importorskip("moto.server", reason="the test extra installs moto[server]")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    bucket = f"meridian-{uuid.uuid4().hex[:12]}"
    try:
        with aws_env(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                     AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}"):  # fmt: skip
            from fsspec.core import url_to_fs

            fs, _ = url_to_fs(f"s3://{bucket}")
            fs.mkdir(bucket)
            yield f"s3://{bucket}"
    finally:
        server.stop()
