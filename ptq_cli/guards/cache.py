"""The user's ptq cache directory: decoded datasets, and the digests of the files ptq wrote that run code
when loaded (TorchScript). Like ssh with its keys, ptq uses it only if no one else can write to it, and every
entry carries a seal, an HMAC under a key only this directory holds: an entry edited and re-digested, or
copied from another machine, is not served.
"""

from __future__ import annotations

import grp
import hashlib
import hmac
import os
import pwd
import secrets
import stat
from pathlib import Path

from ptq_cli import settings
from ptq_cli.errors import PtqError

KEY_FILE = "key"
KEY_BYTES = 32
TRUSTED_DIR = "trusted"


def directory(read_from: Path | None = None) -> Path | None:
    """The cache directory, made private (0700) if new; None if it cannot be made (a read-only home: ptq
    runs without a cache); a one-line error if someone else could write to it, or if it lies inside `read_from`,
    a folder ptq reads (its next read would meet ptq's own files among the images)."""
    root = settings.cache_dir()
    if read_from is not None and Path(read_from).is_dir() and root.resolve().is_relative_to(Path(read_from).resolve()):
        raise PtqError(f"{settings.CACHE_ENV}={root}: inside {read_from}, a folder ptq reads images from; set it to a folder elsewhere")
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = root.stat()
    except OSError:
        return None
    problem = _others_can_write(info)
    if problem:
        raise PtqError(f"{root}: cache directory {problem}; `chmod go-w {root}` or set {settings.CACHE_ENV} to a directory of your own")
    return root


def _others_can_write(info: os.stat_result) -> str:
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != os.geteuid():
        return "belongs to another user"
    if info.st_mode & stat.S_IWOTH:
        return "is writable by everyone"
    if info.st_mode & stat.S_IWGRP and not _private_group(info.st_gid):
        return "is writable by its group"
    return ""


def _private_group(gid: int) -> bool:
    """A group holding only this user (the usual per-user group): group write gives no one else access."""
    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(os.geteuid())
    except KeyError:
        return False
    return group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def _key(root: Path) -> bytes:
    path = root / KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    except OSError as error:
        raise PtqError(f"{path}: cannot create the cache key ({error.strerror or error})") from error
    else:
        with os.fdopen(fd, "wb") as handle:
            handle.write(secrets.token_bytes(KEY_BYTES))
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise PtqError(f"{path}: the cache key must be a file of yours that only you can read (chmod 600 it, or delete it)")
        with path.open("rb") as handle:
            key = handle.read(KEY_BYTES + 1)
    except OSError as error:
        raise PtqError(f"{path}: cannot read the cache key ({error.strerror or error})") from error
    if len(key) != KEY_BYTES:
        raise PtqError(f"{path}: not a ptq cache key ({len(key)} bytes); delete it")
    return key


def seal(*parts: str | bytes) -> str:
    """An HMAC-SHA256 of `parts` under this cache's key."""
    root = directory()
    if root is None:
        raise PtqError(f"{settings.cache_dir()}: no cache directory")
    mac = hmac.new(_key(root), digestmod=hashlib.sha256)
    for part in parts:
        data = part.encode("utf-8", "surrogateescape") if isinstance(part, str) else part
        mac.update(len(data).to_bytes(8, "little") + data)
    return mac.hexdigest()


def sealed(expected: str, *parts: str | bytes) -> bool:
    return hmac.compare_digest(expected, seal(*parts))


def remember_written(sha256: str) -> None:
    """Record that ptq wrote the file of this sha256 (a format whose loading runs code)."""
    from ptq_cli.guards.atomic import write_text

    root = directory()
    if root is not None:
        write_text(root / TRUSTED_DIR / sha256, seal("written", sha256) + "\n")


def was_written(sha256: str) -> bool:
    root = directory()
    path = root / TRUSTED_DIR / sha256 if root is not None else None
    if path is None or not path.is_file():
        return False
    try:
        with path.open("rb") as handle:
            return sealed(handle.read(64).decode("ascii", errors="replace"), "written", sha256)
    except OSError:
        return False
