"""Opening the location of a dump set (a folder or an fsspec URL), for the writer and the reader alike.

A `gs://` location is probed before gcsfs is handed it: gcsfs retries an unreachable host six times
with exponential backoff (about 30 s a request, behind a logged traceback per try) and looks for a
GCE metadata server first (about 15 s more). A host that does not answer a TCP connect within
`CONNECT_TIMEOUT_S`, `CONNECT_TRIES` times, is reported on one line instead. gcsfs's own log records
go to a `NullHandler`, so they reach the user only through a logging configuration of their own.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import urllib.parse

import fsspec

from kda_spec.extras import MissingExtra

CONNECT_TIMEOUT_S = 5.0
CONNECT_TRIES = 2
RETRY_PAUSE_S = 1.0
GCS_PROTOCOLS = ("gs", "gcs")
GCS_ENDPOINT = "https://storage.googleapis.com"
LOCAL_PROTOCOLS = ("file", "local", "memory")


class LocationError(ValueError):
    """A location that cannot be opened; the message is one line naming the URL."""


def open_location(url: str, *, cached: bool = False) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and root path of `url`. With `cached`, a remote location is read through a local
    cache, so each file is fetched once."""
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    is_remote = protocol not in (*LOCAL_PROTOCOLS, "simplecache")
    try:
        fsspec.get_filesystem_class(protocol)  # imports the implementation, connects nowhere
    except ImportError as err:
        if protocol in GCS_PROTOCOLS:
            raise LocationError(str(MissingExtra(url, "gcsfs"))) from None
        raise LocationError(f"{url}: cannot open ({err})") from None
    except ValueError as err:
        raise LocationError(f"{url}: cannot open ({err})") from None
    if protocol in GCS_PROTOCOLS:
        logging.getLogger("gcsfs").addHandler(logging.NullHandler())
        check_reachable(gcs_endpoint(), url)
    try:
        return fsspec.core.url_to_fs(f"simplecache::{url}" if cached and is_remote else url)
    except (ImportError, ValueError, OSError) as err:
        raise LocationError(f"{url}: cannot open ({err})") from None


def gcs_endpoint() -> str:
    """The endpoint gcsfs talks to: `STORAGE_EMULATOR_HOST` when set (as gcsfs reads it), else Google's."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if emulator in ("", "default"):
        return GCS_ENDPOINT
    return emulator if emulator.startswith(("http://", "https://")) else f"http://{emulator}"


def check_reachable(endpoint: str, url: str) -> None:
    """Return once a TCP connection to `endpoint` opens; else a LocationError after `CONNECT_TRIES`
    tries of `CONNECT_TIMEOUT_S` each."""
    parsed = urllib.parse.urlsplit(endpoint)
    host = parsed.hostname or endpoint
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    for attempt in range(CONNECT_TRIES):
        if attempt:
            time.sleep(RETRY_PAUSE_S)
        try:
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
            return
        except OSError as err:
            reason = str(err) or type(err).__name__
    raise LocationError(
        f"{url}: cannot reach {host}:{port} ({reason}; {CONNECT_TRIES} tries of {CONNECT_TIMEOUT_S:g} s): "
        "no network, or no route to Google Cloud Storage"
    )
