"""Tree persistence: the .npz file format and the compact config of `Tree.get_config`.

Both store only ``child_begin``, ``slot_child`` and ``num_classes``; reading goes
back through the validating constructor (passed in as `build`), so a loaded tree
is as checked as a built one.
"""

from __future__ import annotations

import base64
import binascii
import collections.abc
import os
import zipfile
import zlib

import numpy as np

# Written into every saved file; `load` refuses files without them, so a foreign
# .npz fails with a clear message instead of a confusing layout error.
FORMAT_NAME = "tf_hsm.Tree"
FORMAT_VERSION = 1

# How `config_of` writes the layout arrays: differences of consecutive entries
# (most are 1 or small in every builder's trees) as little-endian int64, deflated,
# in base64. A JSON list of a 10M-class tree is ~90 MB and millions of Python ints
# that Keras walks one by one when it loads a layer; this string is ~0.2 MB.
CONFIG_ENCODING = "int64-delta-zlib-base64"


def encode_ints(values):
    """An int64 array as the `CONFIG_ENCODING` string (also used for a layer's class order)."""
    deltas = np.diff(np.asarray(values, np.int64), prepend=np.int64(0))
    return base64.b64encode(zlib.compress(deltas.astype("<i8").tobytes(), 6)).decode("ascii")


def decode_ints(text, name, owner="tree config"):
    """Inverse of `encode_ints`; ValueError naming `owner`'s `name` if `text` is not one."""
    if not isinstance(text, str):
        raise ValueError(f"{owner}'s {name} must be a string in the "
                         f"{CONFIG_ENCODING!r} encoding, got {type(text).__name__}")
    try:
        raw = zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True))
    except (binascii.Error, UnicodeEncodeError, zlib.error) as e:
        raise ValueError(f"{owner}'s {name} is corrupt: {e}") from None
    if len(raw) % 8:
        raise ValueError(f"{owner}'s {name} is corrupt: {len(raw)} bytes is not "
                         "a whole number of int64 values")
    # Wrapping int64 sums undo wrapping differences, so every int64 array round-trips.
    return np.cumsum(np.frombuffer(raw, "<i8"), dtype=np.int64)


def save(tree, path):
    """Writes `tree` to `path` (a file name, os.PathLike or binary file object)."""
    payload = dict(
        format=np.array(FORMAT_NAME),
        version=np.array(FORMAT_VERSION, np.int64),
        num_classes=np.array(tree.num_classes, np.int64),
        child_begin=tree.child_begin,
        slot_child=tree.slot_child,
    )
    if hasattr(path, "write"):
        np.savez(path, **payload)
    else:
        # An open file, so that NumPy writes at exactly `path` (no .npz appended).
        with open(os.fspath(path), "wb") as f:
            np.savez(f, **payload)


def load(path, build):
    """Reads a file written by `save` and returns ``build(child_begin, slot_child, C)``.

    A ValueError from `build` is re-raised naming the file.
    """
    if hasattr(path, "read"):
        return _load_from(path, getattr(path, "name", "<file object>"), build)
    with open(os.fspath(path), "rb") as f:
        return _load_from(f, os.fspath(path), build)


def _load_from(f, name, build):
    try:
        data = np.load(f, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{name} is not a tf_hsm tree file: {e}") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValueError(f"{name} is not a tf_hsm tree file (not an .npz archive)")
    with data:
        needed = {"format", "version", "num_classes", "child_begin", "slot_child"}
        missing = needed - set(data.files)
        if missing:
            raise ValueError(
                f"{name} is not a tf_hsm tree file: missing {sorted(missing)}")
        try:
            fmt = data["format"]
            version = data["version"]
            num_classes = data["num_classes"]
            child_begin = data["child_begin"]
            slot_child = data["slot_child"]
        except Exception as e:  # corrupt member: zlib, zip, header errors
            raise ValueError(f"{name} is corrupt: {e}") from None
    if fmt.shape != () or str(fmt) != FORMAT_NAME:
        raise ValueError(f"{name} is not a tf_hsm tree file (format {fmt!r})")
    if version.shape != () or version.dtype.kind not in "iu":
        raise ValueError(f"{name} has an invalid format version {version!r}")
    if int(version) > FORMAT_VERSION:
        raise ValueError(
            f"{name} uses tree format version {int(version)}; this tf_hsm reads "
            f"up to {FORMAT_VERSION}")
    if num_classes.shape != () or num_classes.dtype.kind not in "iu":
        raise ValueError(f"{name} has an invalid num_classes {num_classes!r}")
    try:
        return build(child_begin, slot_child, int(num_classes))
    except ValueError as e:
        raise ValueError(f"{name} holds an invalid tree: {e}") from None


def config_of(tree):
    """The JSON-serializable dict of `Tree.get_config`, arrays in `CONFIG_ENCODING`."""
    return {
        "num_classes": tree.num_classes,
        "encoding": CONFIG_ENCODING,
        "child_begin": encode_ints(tree.child_begin),
        "slot_child": encode_ints(tree.slot_child),
    }


def layout_from_config(config):
    """``(child_begin, slot_child, num_classes)`` of a config, not yet validated.

    Besides what `config_of` writes, a config without "encoding" holding plain
    lists of ints is accepted: configs written before the compact encoding, and
    configs written by hand.
    """
    if not isinstance(config, collections.abc.Mapping):
        raise ValueError(f"tree config must be a dict, got {type(config).__name__}")
    try:
        child_begin, slot_child = config["child_begin"], config["slot_child"]
        num_classes = config["num_classes"]
    except KeyError as e:
        raise ValueError(f"tree config is missing {e}") from None
    encoding = config.get("encoding")
    if encoding is not None:
        if encoding != CONFIG_ENCODING:
            raise ValueError(
                f"tree config has an unknown encoding {encoding!r}; this tf_hsm "
                f"reads {CONFIG_ENCODING!r} or plain lists")
        child_begin = decode_ints(child_begin, "child_begin")
        slot_child = decode_ints(slot_child, "slot_child")
    return child_begin, slot_child, num_classes
