"""The API keys of `pagedq serve`: each key is a tenant with a name, an id and limits of its own.

A key's id is the first 16 hex digits of the SHA-256 of the key: what Redis records as the owner of the key's
files, batches and jobs, and what names its counters there. The key itself is never stored, logged or shown; its
name is what logs and metrics show.

The key file holds one key a line: `[NAME[:]] SECRET [rpm=N] [tpm=N] [max_jobs=N] [max_batches=N]
[max_file_bytes=N] [lane=LANE] [top_priority=N]`, where SECRET is the key as clients send it, or `sha256:<64 hex digits>`, its SHA-256, so that
the file need not hold the key. A key without a name is named by its id. Blank lines and lines starting with #
are skipped. The limits override the server's (`--key-rpm`, `--key-tpm`, `--key-max-jobs`, `--key-max-batches`,
`--key-max-file-bytes`) for that key; 0 lifts one. `lane=` (interactive, default or batch; interactive if not
given) is the lane the key's completion requests go to, and the most urgent it may ask for (serve.lanes);
`top_priority=` (an integer, 0 if not given, may be negative) the most urgent `priority` it may send (lower runs
first): a request asking for more gets a 400. SIGHUP reloads the file in every serve
process (serve.app); a file that does not parse leaves the keys as they were.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

from producer.keys import LANES
from producer.protocol import INT32_MAX

KEY_ID_HEX = 16
_NAME_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
_HASH_RE = re.compile(r"^sha256:([0-9a-fA-F]{64})$")
_LIMIT_RE = re.compile(r"^(rpm|tpm|max_jobs|max_batches|max_file_bytes)=(\d+)$")
_OPTION_RE = re.compile(r"^(lane|top_priority)=(.*)$")
_INT_RE = re.compile(r"^-?\d{1,10}$")
INTERACTIVE = "interactive"
SYNTAX = ("`[NAME:] KEY [rpm=N] [tpm=N] [max_jobs=N] [max_batches=N] [max_file_bytes=N] [lane=LANE] "
          "[top_priority=N]`")


def digest(secret: str) -> str:
    """The SHA-256 of a key, as hex."""
    return hashlib.sha256(secret.encode()).hexdigest()


def key_id(secret: str) -> str:
    """The id of a key: what Redis records as the owner of what it makes."""
    return digest(secret)[:KEY_ID_HEX]


@dataclass(frozen=True)
class ApiKey:
    """One key, as the server knows it: never the key itself, only its digest. A limit of None is the server's
    (ServeConfig.key_rpm, ...); 0 is none."""

    name: str
    digest: str
    rpm: int | None = None
    tpm: int | None = None
    max_jobs: int | None = None
    max_batches: int | None = None
    max_file_bytes: int | None = None
    lane: str = INTERACTIVE  # its requests' lane, and the most urgent one it may ask for
    top_priority: int = 0  # the most urgent (lowest) `priority` its requests may ask for

    @property
    def id(self) -> str:
        return self.digest[:KEY_ID_HEX]


class KeyFileError(ValueError):
    pass


def parse_line(line: str, where: str = "") -> ApiKey | None:
    """One line of a key file: its key, or None for a blank line or a comment."""
    words = line.split()
    if not words or words[0].startswith("#"):
        return None
    limits: dict[str, int | str] = {}
    rest = []
    for w in words:
        m = _LIMIT_RE.match(w)
        o = _OPTION_RE.match(w) if m is None else None
        if m:
            limits[m.group(1)] = int(m.group(2))
        elif o:
            limits[o.group(1)] = _option(o.group(1), o.group(2), where)
        else:
            rest.append(w)
    if len(rest) not in (1, 2):
        raise KeyFileError(f"{where}give {SYNTAX} (a key has no spaces)")
    secret = rest[-1]
    m = _HASH_RE.match(secret)
    hashed = m.group(1).lower() if m else digest(secret)
    name = rest[0].removesuffix(":") if len(rest) == 2 else hashed[:KEY_ID_HEX]
    if not _NAME_RE.match(name):
        raise KeyFileError(f"{where}a key's name is 1-64 characters of [A-Za-z0-9_.@-], got {name!r}")
    return ApiKey(name, hashed, **limits)


def _option(name: str, value: str, where: str) -> int | str:
    if name == "lane":
        if value not in LANES:
            raise KeyFileError(f"{where}lane= must be one of {', '.join(LANES)}, got {value!r}")
        return value
    if not _INT_RE.match(value) or abs(int(value)) > INT32_MAX:
        raise KeyFileError(f"{where}top_priority= must be an integer from {-INT32_MAX} to {INT32_MAX} (lower runs "
                           f"first), got {value!r}")
    return int(value)


def parse(text: str, source: str = "key file") -> list[ApiKey]:
    """The keys of a key file's text; KeyFileError names the first line that is wrong (never the key in it)."""
    out: list[ApiKey] = []
    for n, line in enumerate(text.splitlines(), 1):
        key = parse_line(line, f"{source}, line {n}: ")
        if key is not None:
            out.append(key)
    return out


def read_key_file(path: str | Path) -> list[ApiKey]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise KeyFileError(f"cannot read the key file {path}: {e.strerror}") from None
    return parse(text, str(path))


def plain(secrets: list[str]) -> list[ApiKey]:
    """Keys given on the command line: each the key itself, named by its id."""
    return [ApiKey(key_id(s), digest(s)) for s in secrets]


class KeyRing:
    """The keys one serve process accepts: those of the command line and those of the key file, which `reload`
    reads again. Auth is on when either was given, even if the file holds no key now: an emptied file refuses
    everyone, it never opens the server."""

    def __init__(self, secrets: list[str], path: str | None = None) -> None:
        self.fixed = plain(secrets)
        self.path = path
        self.enabled = bool(secrets or path)
        self.keys: tuple[ApiKey, ...] = self._check(self.fixed + (read_key_file(path) if path else []))

    @staticmethod
    def _check(keys: list[ApiKey]) -> tuple[ApiKey, ...]:
        names: dict[str, ApiKey] = {}
        ids: set[str] = set()
        for k in keys:
            if k.id in ids:
                raise KeyFileError(f"the key named {k.name!r} is given twice (two keys with one id)")
            if k.name in names:
                raise KeyFileError(f"two keys are named {k.name!r}")
            names[k.name] = k
            ids.add(k.id)
        return tuple(keys)

    def reload(self) -> tuple[ApiKey, ...]:
        """Read the key file again; KeyFileError (the keys stay as they were) when it does not parse."""
        if self.path:
            self.keys = self._check(self.fixed + read_key_file(self.path))
        return self.keys

    def identify(self, token: str) -> ApiKey | None:
        """The key `token` is, compared with every key's digest in constant time: how long a refusal takes tells
        nothing of any key."""
        d = digest(token).encode()
        found = None
        for k in self.keys:
            if hmac.compare_digest(d, k.digest.encode()):
                found = k
        return found

    def by_id(self, key_id_: str) -> ApiKey | None:
        return next((k for k in self.keys if k.id == key_id_), None)
