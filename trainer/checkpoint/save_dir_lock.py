"""One train run per save directory, and a save directory that can be written, both
found before training starts.

The lock is flock(2) on the save directory itself, held by rank 0 for the life of the
run. The kernel drops it when the process ends, however it ends, so a run that died never
blocks the next one. Who holds it (pid and host) goes to `<save-dir>/.lock` for the
message a second run prints; the file is removed when the run ends (one that was killed
leaves it, and the next run overwrites it). Writing that file is also the check that the
directory can be written at all. A run refused here leaves the directory as it found it.
"""

import fcntl
import json
import logging
import os
import socket
from pathlib import Path

from data.atomic_file import write_atomically

OWNER_FILE = ".lock"
log = logging.getLogger("shardlm")


class SaveDirLock:
    def __init__(self, save_dir):
        self.save_dir = Path(save_dir)
        self.fd = None
        self.created = []  # directories this run made, deepest first: removed again if left empty

    def acquire(self):
        """Lock the directory (creating it). Returns None, or why it cannot be used (one line)."""
        try:
            self.created = [p for p in (self.save_dir, *self.save_dir.parents) if not p.exists()]
            self.save_dir.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.save_dir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            self.remove_created()
            return self.not_writable(e)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = None
            return (
                f"{self.save_dir} is in use by another train run ({self.owner()}); "
                "wait for it or choose another --save-dir"
            )
        except OSError as e:  # a filesystem without flock (some NFS and Lustre mounts)
            log.warning(
                f"cannot lock {self.save_dir} ({e.strerror}): nothing stops a second run from writing there too"
            )
        return self.write_owner()

    def write_owner(self):
        try:
            write_atomically(
                self.save_dir / OWNER_FILE, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n"
            )
        except OSError as e:
            self.release()
            return self.not_writable(e)
        return None

    def not_writable(self, e):
        why = e.strerror or type(e).__name__
        return (
            f"--save-dir {self.save_dir} is not writable ({why}); choose a directory you can write "
            "to, or pass --no-save"
        )

    def owner(self):
        try:
            info = json.loads((self.save_dir / OWNER_FILE).read_text())
            return f"pid {info['pid']} on host {info['host']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "it is still starting"

    def release(self):
        """Unlock; remove the owner file, and the directory if this run created it and left it empty."""
        if self.fd is None:
            return
        try:
            (self.save_dir / OWNER_FILE).unlink(missing_ok=True)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None
        self.remove_created()

    def remove_created(self):
        for path in self.created:
            try:
                path.rmdir()
            except OSError:
                return  # the run wrote something there: keep it
        self.created = []
