"""Give a file written through a private temporary file the mode a plain `open(path, "w")` gives.

safetensors >= 0.8 writes `save_file` into a `tempfile::NamedTempFile` beside the destination and
renames it into place (safetensors PR #764, so that saving over a memory-mapped source is safe). The
tempfile crate creates that file with mode 0600 whatever the umask, so `model.safetensors` came out
readable by its owner only while every other file of an export is 0644 under the usual umask 022: a
folder exported by one user could not be served by another (a service account, a container with
another uid). Upstream: safetensors issue #782 (open at the time of writing).
"""
import os
from pathlib import Path


def current_umask() -> int:
    """This process's umask: read from /proc/self/status where Linux reports it (no change, so no race
    with other threads creating files); elsewhere set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def set_plain_file_mode(path: Path) -> None:
    """chmod `path` to 0666 minus the umask: the mode of a new file written with `open`."""
    os.chmod(path, 0o666 & ~current_umask())
