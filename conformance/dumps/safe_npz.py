"""Reading an .npz archive from untrusted bytes: every member checked before anything is allocated.

`np.load` trusts the archive: a member that is not an .npy comes back as raw bytes, and an .npy
header declaring 2**50 elements allocates petabytes before any check can run. Here each member must
be an .npy of a plain numeric dtype whose declared size is exactly the bytes the member holds.
"""

from __future__ import annotations

import io
import lzma
import math
import zipfile
import zlib

import numpy as np

_NPY_SUFFIX = ".npy"
_NUMERIC_KINDS = "biuf"  # bool, signed and unsigned integers, floats
_READ_ERRORS = (
    OSError,
    EOFError,
    ValueError,
    zipfile.BadZipFile,
    zlib.error,
    lzma.LZMAError,
    NotImplementedError,  # a compression method zipfile does not know
    RuntimeError,  # an encrypted member
)


class NpzError(ValueError):
    """An archive that is not a well-formed .npz of numeric arrays; the message names the member."""


def load_npz(data: bytes) -> dict[str, np.ndarray]:
    """The arrays of an .npz archive by key (member name without `.npy`)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except _READ_ERRORS as err:
        raise NpzError(f"not a readable .npz file ({type(err).__name__}: {err})") from None
    with archive:
        members = archive.infolist()
        names = [member.filename for member in members]
        duplicated = sorted({name for name in names if names.count(name) > 1})
        if duplicated:
            raise NpzError(f"member(s) {duplicated} appear more than once")
        arrays = {}
        for member in members:
            key = _key(member.filename)
            try:
                arrays[key] = _read_member(archive, member)
            except NpzError:
                raise
            except _READ_ERRORS as err:
                raise NpzError(
                    f"member {member.filename!r}: not a readable .npy ({type(err).__name__}: {err})"
                ) from None
        return arrays


def _key(name: str) -> str:
    if not name.endswith(_NPY_SUFFIX) or name == _NPY_SUFFIX:
        raise NpzError(f"member {name!r} is not an .npy array")
    return name[: -len(_NPY_SUFFIX)]


def _read_member(archive: zipfile.ZipFile, member: zipfile.ZipInfo) -> np.ndarray:
    where = f"member {member.filename!r}"
    with archive.open(member) as stream:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise NpzError(f"{where}: .npy format version {version} is not supported (1.0 or 2.0)")
        if dtype.kind not in _NUMERIC_KINDS or dtype.fields is not None or dtype.subdtype is not None:
            raise NpzError(f"{where}: dtype {dtype} is not a plain numeric dtype")
        declared = math.prod(shape) * dtype.itemsize
        held = member.file_size - stream.tell()
        if declared != held:
            raise NpzError(
                f"{where}: header declares shape {tuple(shape)} of {dtype} ({declared} bytes), "
                f"the member holds {held} bytes"
            )
        payload = stream.read(held)
    if len(payload) != held:
        raise NpzError(f"{where}: truncated: {len(payload)} of {held} bytes")
    array = np.frombuffer(payload, dtype=dtype).reshape(shape, order="F" if fortran_order else "C")
    return array.copy()
