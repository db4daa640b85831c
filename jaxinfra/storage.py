"""Object storage: `gs://` and `s3://` URLs wherever a run reads or writes files.

A local path stays a `pathlib.Path` and takes exactly the code path it always took; a URL becomes an
`etils.epath.Path` (fsspec underneath: s3fs for s3://, gcsfs for gs://), which has the same methods
(`/`, `name`, `parent`, `is_file`, `read_text`, `write_text`, `mkdir`, `iterdir`, `open`). Checkpoints go
straight to the bucket through Orbax and TensorStore's own drivers (`install_orbax_s3` below).

Three things are not files on an object store, so they get their own helpers:
- `check_bucket(url)`: a misspelled or unreachable bucket, or refused credentials, is one line naming
  the bucket (StorageError, exit 2) before anything is written anywhere;
- `local_copy(url)`: read-only inputs that need a local file (token files numpy memory-maps, saved
  logits, a token file to score) are copied once into a cache keyed by the URL, completely or not at all;
- `RunStaging`: a run dir's small files (config.yaml, metrics.jsonl, summary.json, TensorBoard events)
  are written to a local staging directory and uploaded at each checkpoint, every `PUSH_EVERY_S` at log
  points, and when the run ends (any way it ends): an S3 object cannot be appended to, and a resumed
  run continues metrics.jsonl from the staged copy it downloaded, exactly as on local disk.

This module imports no jax (`jaxinfra.config` reads URL config files through it) and no fsspec until a
URL is actually used.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import shutil
import time
from typing import Any

SCHEMES = ("gs", "s3")
EXTRAS = {"gs": "gcs", "s3": "s3"}  # pip install 'jaxinfra[<extra>]' brings the fsspec driver
PUSH_EVERY_S = 30.0  # at most this long between uploads of a run's small files (plus every checkpoint)
CHECKPOINTS = "checkpoints"


class StorageError(ValueError):
    """A URL that cannot be used (unsupported scheme, missing or unreachable bucket, refused
    credentials, a missing object): one line naming it, exit 2 (jaxinfra/exits.py bad_input_errors)."""


def is_url(path: Any) -> bool:
    """Whether `path` is a URL (`scheme://...`) rather than a local path."""
    return "://" in str(path)


def split_url(url: Any, what: str = "path") -> tuple[str, str, str]:
    """(scheme, bucket, key) of a gs:// or s3:// URL; StorageError for any other scheme or no bucket."""
    text = str(url)
    scheme, _, rest = text.partition("://")
    if scheme not in SCHEMES:
        raise StorageError(f"{what} {text}: the URL scheme {scheme + '://'!r} is not supported; use gs://, s3:// "
                           f"or a local path")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StorageError(f"{what} {text}: no bucket name after {scheme}://")
    return scheme, bucket, key.strip("/")


def as_path(path: str | os.PathLike) -> Any:
    """A `pathlib.Path` for a local path (unchanged behaviour), an `epath.Path` for a gs:// / s3:// URL."""
    if isinstance(path, pathlib.Path) or not is_url(path):
        return pathlib.Path(path)
    split_url(path)
    from etils import epath

    return epath.Path(str(path))


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path without the scheme) of a URL; one line naming the extra when its driver is absent."""
    scheme, bucket, key = split_url(url)
    import fsspec

    try:
        fs = fsspec.filesystem(scheme)
    except ImportError:
        raise StorageError(f"{url}: {scheme}:// needs its fsspec driver: pip install 'jaxinfra[{EXTRAS[scheme]}]'") \
            from None
    return fs, f"{bucket}/{key}".rstrip("/")


def check_bucket(url: str, what: str = "path") -> None:
    """StorageError naming the bucket if it does not exist, cannot be reached or refuses the credentials."""
    scheme, bucket, _ = split_url(url, what)
    fs, _ = filesystem(url)
    try:
        fs.ls(bucket, detail=False, refresh=True)
    except FileNotFoundError:
        raise StorageError(f"{what} {url}: bucket {scheme}://{bucket} does not exist (check its name)") from None
    except PermissionError:
        raise StorageError(f"{what} {url}: bucket {scheme}://{bucket} refused the credentials (check "
                           f"{_credential_hint(scheme)})") from None
    except Exception as e:  # noqa: BLE001 - connection, DNS, endpoint errors: the bucket is unreachable
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise StorageError(f"{what} {url}: bucket {scheme}://{bucket} cannot be reached ({reason})") from None


def _credential_hint(scheme: str) -> str:
    return ("AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL" if scheme == "s3"
            else "GOOGLE_APPLICATION_CREDENTIALS or `gcloud auth application-default login`")


def cache_root() -> pathlib.Path:
    """Local cache for URL inputs and run staging: $JAXINFRA_CACHE, else ~/.cache/jaxinfra."""
    return pathlib.Path(os.environ.get("JAXINFRA_CACHE") or pathlib.Path.home() / ".cache" / "jaxinfra")


def _digest(url: str) -> str:
    return hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def read_text(path: str | os.PathLike) -> str:
    """The text of a local file or an object (FileNotFoundError when absent, like pathlib)."""
    return as_path(path).read_text()


def local_copy(url: str, what: str = "path") -> str:
    """A local copy of the object or "directory" at `url` (a cached download, refreshed when the
    objects' names or sizes change); a local path is returned as it is.

    Downloaded into a temporary directory first and renamed into place: an interrupted or failed
    download leaves nothing that a later run could take for the data."""
    if not is_url(url):
        return url
    check_bucket(url, what)
    fs, path = filesystem(url)
    listing = _listing(fs, path)
    if not listing:
        raise StorageError(f"{what}: {url} not found (no object or prefix of that name)")
    home = cache_root() / "inputs" / _digest(url)
    name = path.rsplit("/", 1)[-1] or "root"
    signature = json.dumps(sorted(listing.items()))
    marker = home / "complete.json"
    if marker.is_file() and marker.read_text() == signature:
        return str(home / name)
    partial = cache_root() / "inputs" / f".{_digest(url)}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        target = partial / name
        if list(listing) == [""]:  # a single object
            partial.mkdir(parents=True)
            fs.get_file(path, str(target))
        else:
            for rel in listing:
                (target / rel).parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(f"{path}/{rel}", str(target / rel))
        (partial / "complete.json").write_text(signature)
        shutil.rmtree(home, ignore_errors=True)
        partial.rename(home)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return str(home / name)


def _listing(fs: Any, path: str) -> dict[str, int]:
    """{relative name: size} of the objects under `path` ({"": size} for one object; {} if none)."""
    if fs.isfile(path):
        return {"": int(fs.info(path)["size"])}
    found = fs.find(path, detail=True)
    return {name[len(path) + 1:]: int(info.get("size", 0)) for name, info in found.items()
            if info.get("type") != "directory" and name.startswith(path + "/")}


class RunStaging:
    """The small files of a run dir on a bucket, kept in a local directory and mirrored to the bucket.

    `pull()` (at the start, under the run's lock) replaces the staging directory with the bucket's
    files outside `checkpoints/`; `push()` uploads the files changed since the last push. Checkpoints
    never pass through here: Orbax writes them to the bucket itself."""

    def __init__(self, url: str, what: str = "--run-dir"):
        split_url(url, what)
        self.url = str(url).rstrip("/")
        self.local = cache_root() / "runs" / _digest(self.url)
        self._pushed: dict[str, tuple[int, int]] = {}
        self.last_push = 0.0

    def pull(self, skip: tuple[str, ...] = ()) -> None:
        fs, path = filesystem(self.url)
        shutil.rmtree(self.local, ignore_errors=True)
        self.local.mkdir(parents=True)
        if not fs.exists(path):
            return
        for entry in fs.ls(path, detail=True, refresh=True):
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if name in (CHECKPOINTS, *skip):
                continue
            if entry.get("type") == "directory":
                for rel in _listing(fs, f"{path}/{name}"):
                    (self.local / name / rel).parent.mkdir(parents=True, exist_ok=True)
                    fs.get_file(f"{path}/{name}/{rel}", str(self.local / name / rel))
            else:
                fs.get_file(f"{path}/{name}", str(self.local / name))
        self._pushed = {rel: stamp for rel, stamp in self._stamps().items()}

    def push(self) -> None:
        """Upload the staged files that changed since the last push (a file's size and mtime tell)."""
        fs, path = filesystem(self.url)
        for rel, stamp in self._stamps().items():
            if self._pushed.get(rel) != stamp:
                try:
                    fs.put_file(str(self.local / rel), f"{path}/{rel}")
                except Exception as e:  # the store's (or the network's) refusal: a failed write, exit 74
                    reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
                    raise OSError(errno.EIO, f"uploading to the bucket failed: {reason}", f"{self.url}/{rel}") from e
                self._pushed[rel] = stamp
        self.last_push = time.monotonic()

    def _stamps(self) -> dict[str, tuple[int, int]]:
        out = {}
        for d, _, names in os.walk(self.local):
            for n in names:
                st = os.stat(os.path.join(d, n))
                out[os.path.relpath(os.path.join(d, n), self.local)] = (st.st_size, st.st_mtime_ns)
        return out


# ---------------------------------------------------------------- Orbax / TensorStore on s3://

# Orbax 0.12.8 builds TensorStore kvstore specs natively only for gs://: every other path becomes a
# local `file` spec (after os.path.normpath has turned s3://b/x into s3:/b/x). These three functions of
# orbax/checkpoint/_src (tensorstore_utils._normalize_path, ._use_gcs_driver, gcs_utils.get_kvstore_for_gcs)
# are taught s3:// here, once per process; tests/test_storage.py fails if a future Orbax renames them.
_ORBAX_PATCHED = False


def s3_kvstore(url: str) -> dict[str, Any]:
    """TensorStore's s3 kvstore spec for an s3:// URL. TensorStore does not read AWS_ENDPOINT_URL: it is
    passed here. With AWS_ACCESS_KEY_ID set, the credentials come from the environment alone (its default
    chain also works, but first logs a page about a missing ~/.aws/config); else its default chain
    (~/.aws profiles, the instance's metadata service)."""
    _, bucket, key = split_url(url)
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key}
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        spec["aws_credentials"] = {"type": "environment"}
    if os.environ.get("AWS_ENDPOINT_URL"):
        spec["endpoint"] = os.environ["AWS_ENDPOINT_URL"]
    if os.environ.get("AWS_REGION"):
        spec["aws_region"] = os.environ["AWS_REGION"]
    return spec


def install_orbax_s3() -> None:
    """Let Orbax write and read checkpoints at s3:// URLs through TensorStore's s3 driver (idempotent)."""
    global _ORBAX_PATCHED
    if _ORBAX_PATCHED:
        return
    from orbax.checkpoint._src.path import gcs_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    normalize, use_gcs, gcs_kvstore = ts_utils._normalize_path, ts_utils._use_gcs_driver, gcs_utils.get_kvstore_for_gcs

    def _normalize_path(path: str) -> str:
        return normalize(path).replace("s3:/", "s3://", 1) if str(path).startswith("s3://") else normalize(path)

    def _use_gcs_driver(directory: str) -> bool:  # "remote, not a local file": the caller then asks for the kvstore
        return directory.startswith("s3://") or use_gcs(directory)

    def get_kvstore_for_gcs(path: str) -> dict[str, Any]:
        return s3_kvstore(path) if str(path).startswith("s3://") else gcs_kvstore(path)

    ts_utils._normalize_path, ts_utils._use_gcs_driver = _normalize_path, _use_gcs_driver
    gcs_utils.get_kvstore_for_gcs = get_kvstore_for_gcs
    _ORBAX_PATCHED = True


def orbax_options(directory: Any) -> dict[str, Any]:
    """Extra CheckpointManagerOptions for a bucket: commit by a marker file, not by renaming a
    temporary directory (a rename on S3 is a copy of every object); {} for a local directory."""
    if not is_url(directory):
        return {}
    install_orbax_s3()
    from orbax.checkpoint._src.path import atomicity

    return {"temporary_path_class": atomicity.CommitFileTemporaryPath}
