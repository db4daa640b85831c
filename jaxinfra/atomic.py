"""The one way jaxinfra writes a user-visible output: build it under a temporary name beside it, then rename.

    atomic_write_text(path, text, replace=True)     # a small file (config.yaml, summary.json, a fit)
    with atomic_file(path, "wb") as f: ...          # a streamed file (a safetensors file, a plot)
    with atomic_dir(out, replace=args.overwrite) as tmp: ...   # a directory output, built in `tmp`

A file is written to `NAME.tmp-<pid>` in the same directory, flushed and fsynced, then `os.replace`d
onto NAME; a directory is built in the sibling `OUT.tmp-<pid>` and renamed to OUT when its block ends
without an error (over an existing OUT: the two are swapped in one `renameat2(RENAME_EXCHANGE)` where
Linux offers it, else OUT is first renamed to `OUT.old-<pid>`). So a reader, or a rerun after a crash,
only ever finds the old output or the new one, whole: never a truncated file under its final name, and
never new weights beside an old config. An error inside the block removes the temporary; one left by a
killed process (SIGKILL, a lost node) is recognisable by its name and removed by the next write of the
same output once its process is gone.

An existing output is refused (OutputExistsError: exit 2, one line naming the path and the flag that
replaces it) unless the caller passes replace=True: outputs the user names (an export, a quantized
run) are replaced only when asked, while a run's own small files pass replace=True. An existing empty
directory is not an output: it is used (the user may have made it first).

On gs:// / s3:// (jaxinfra/storage.py) an object is written in one PUT, all or nothing, so files are
written in place; a directory output is written straight to its final prefix (an object store has no
rename), after the same refusal. Checkpoints are not written here: Orbax commits them itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import pathlib
import re
import shutil
from collections.abc import Iterator, Sequence
from typing import IO, Any

from jaxinfra import storage

TMP, OLD = ".tmp-", ".old-"  # NAME.tmp-<pid>: being written; NAME.old-<pid>: the replaced output, being removed


class OutputExistsError(ValueError):
    """An output path that holds something already (or something of the wrong kind): exit 2, one line."""


def temporary(path: Any, kind: str = TMP) -> Any:
    """The temporary sibling of `path` that this process writes (`NAME.tmp-<pid>`)."""
    return path.with_name(f"{path.name}{kind}{os.getpid()}")


def is_temporary(name: str) -> bool:
    """Whether a file name is one of ours in the making (or being removed): readers skip such names."""
    return re.search(r"\.(tmp|old)-\d+", name) is not None


def check_output(path: Any, replace: bool, directory: bool, flag: str | None = "--overwrite",
                 inputs: Sequence[Any] = ()) -> bool:
    """Whether `path` holds an output already (True: the caller may replace it); OutputExistsError when it
    holds one and `replace` is off, holds a directory where a file goes (or a file where a directory goes),
    or is (or holds) one of the command's `inputs`, which replacing it would destroy."""
    path = storage.as_path(path)
    if not path.exists():
        return False
    for source in inputs:
        if not storage.is_url(path) and not storage.is_url(source) and _within(source, path):
            raise OutputExistsError(f"{path} is or holds the input {source}; write the output somewhere else")
    if path.is_dir() != directory:
        what, wanted = ("a directory", "a file") if path.is_dir() else ("a file", "a directory")
        raise OutputExistsError(f"{path} is {what}; the output is {wanted}: give another path")
    if directory and not any(path.iterdir()):
        return False  # an empty directory holds nothing to lose
    if not replace:
        how = f"pass {flag} to replace it" if flag else "choose another path"
        raise OutputExistsError(f"{path} already exists; {how}")
    return True


def _within(inner: Any, outer: Any) -> bool:
    inner, outer = pathlib.Path(inner).resolve(), pathlib.Path(outer).resolve()
    return inner == outer or outer in inner.parents


def clean_stale(path: Any) -> None:
    """Remove the temporaries of `path` that processes no longer alive on this host left behind
    (`NAME.tmp-<pid>`, `NAME.old-<pid>`, and what Orbax hangs on them: `NAME.tmp-<pid>.orbax-...`)."""
    if storage.is_url(path) or not path.parent.is_dir():
        return
    for sibling in path.parent.iterdir():
        for kind in (TMP, OLD):
            if not sibling.name.startswith(path.name + kind):
                continue
            pid = re.match(r"\d+", sibling.name[len(path.name + kind):])
            if pid is not None and not _alive(int(pid.group())):
                _remove(sibling)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # an earlier attempt of this very process (a retry in the same interpreter)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _remove(path: Any) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _fsync_dir(path: pathlib.Path) -> None:
    """Make a rename in `path` durable (a crash after it must not bring the old name back)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot sync a directory; the rename itself is still atomic
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", *, replace: bool = False, flag: str | None = "--overwrite",
                encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """A file object writing `path`'s temporary; on a clean exit it is synced and renamed onto `path`."""
    path = storage.as_path(path)
    check_output(path, replace, directory=False, flag=flag)
    binary = "b" in mode
    if storage.is_url(path):  # one PUT: all or nothing
        with path.open(mode, **({} if binary else {"encoding": encoding})) as f:
            yield f
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path)
    tmp = temporary(path)
    try:
        with open(tmp, mode, **({} if binary else {"encoding": encoding})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, replace: bool = False,
                       flag: str | None = "--overwrite") -> Any:
    """Write `data` to `path` through its temporary (atomic_file); returns the path."""
    with atomic_file(path, "wb", replace=replace, flag=flag) as f:
        f.write(data)
    return storage.as_path(path)


def atomic_write_text(path: str | os.PathLike, text: str, *, replace: bool = False, flag: str | None = "--overwrite",
                      encoding: str = "utf-8") -> Any:
    """Write `text` to `path` through its temporary (atomic_file); returns the path."""
    with atomic_file(path, "w", replace=replace, flag=flag, encoding=encoding) as f:
        f.write(text)
    return storage.as_path(path)


def atomic_copy(src: str | os.PathLike, dst: str | os.PathLike, *, replace: bool = False) -> None:
    """Copy the file `src` to `dst` through `dst`'s temporary."""
    with open(src, "rb") as s, atomic_file(dst, "wb", replace=replace) as d:
        shutil.copyfileobj(s, d)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, *, replace: bool = False, flag: str | None = "--overwrite",
               inputs: Sequence[Any] = ()) -> Iterator[Any]:
    """The directory to build output `path` in; on a clean exit it becomes `path` (the old one, with
    replace=True, goes whole). On an error the partial build is removed and `path` is untouched.
    `inputs`: paths the command reads, which `path` must not be or hold (check_output)."""
    path = storage.as_path(path)
    existed = check_output(path, replace, directory=True, flag=flag, inputs=inputs)
    if storage.is_url(path):  # no rename on an object store: straight to the prefix, after the refusal
        if existed:
            path.rmtree()
        yield path
        return
    path = pathlib.Path(os.path.abspath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path)
    tmp = temporary(path)
    _remove(tmp)
    tmp.mkdir()
    try:
        yield tmp
        _put_in_place(tmp, path, existed)
    except BaseException:
        _remove(tmp)
        raise
    _fsync_dir(path.parent)


def _put_in_place(tmp: pathlib.Path, path: pathlib.Path, existed: bool) -> None:
    """Rename the finished `tmp` to `path`, swapping out an existing output in one step where possible."""
    if not existed:
        os.replace(tmp, path)  # onto nothing, or onto an empty directory: one atomic rename
        return
    if _exchange(tmp, path):  # path is now the new output, tmp the old one
        _remove(tmp)
        return
    old = temporary(path, OLD)
    os.rename(path, old)  # a crash here leaves OUT.old-<pid> (the old output, whole) and OUT.tmp-<pid>
    os.replace(tmp, path)
    _remove(old)


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Linux renameat2(RENAME_EXCHANGE): swap two paths atomically. False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False  # a filesystem (or kernel) without the exchange: the two-rename fallback
    raise OSError(err, os.strerror(err), str(b))


def add_overwrite(parser: Any) -> None:
    """The one `--overwrite` flag of every command that writes a named output (argparse)."""
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output (built beside it, then swapped in whole; without the "
                             "flag an existing output is refused)")
