"""Output that nobody reads never stops a run: stdout and stderr that outlive their reader.

A training run talks to its console, but the console is not its record: metrics.jsonl, the
checkpoints and summary.json are. Yet a console can go away while the run goes on:

- `python train_ppo.py ... | head -1`, or a `tee` that was killed: the pipe's reader is gone. The
  kernel answers the next write with SIGPIPE, whose default action kills the writer (that is how
  `yes | head` ends). Python ignores SIGPIPE at start-up, so the write raises BrokenPipeError
  (EPIPE) instead, wherever it happens: under verl's console logger (trainer.logger=console, or no
  logger key: harness/tracking.py prints verl's line to stdout every step) that is step 1 or 2, and
  with verl's default save_freq=-1 the whole run was lost to a message nobody could read;
- a terminal that went away (an ssh session closed under a process that ignores SIGHUP): EIO;
- a stream closed before the start (`2>&-`): Python then sets sys.stderr to None, and the first
  tqdm bar or tqdm.write fails on it (AttributeError); one closed later gives EBADF, or ValueError
  ("I/O operation on closed file") from a Python stream that was closed.

`guard()`, called first by train_ppo.py's command line (harness/cli.py), puts each of sys.stdout and
sys.stderr behind `Guarded`: its first write or flush that fails in one of these ways marks the
stream dead and says nothing (there is nobody to tell, and the message would fail the same way);
later writes are dropped, the run goes on and ends with the status it would have had. tqdm reaches
the guard too: a bar without `file=` takes sys.stderr when it is created, after the guard, and
nanokl passes `file=sys.stderr` at the call. Any other error (ENOSPC under `> log` on a full disk)
is raised as before: that is no reader gone.

Two details of the standard recipe (Python's docs, "Note on SIGPIPE"):
- at exit Python flushes sys.stdout; data still buffered for a broken pipe then fails there, which
  prints "Exception ignored ... BrokenPipeError" and turns the exit status into 120. A dead stream's
  file descriptor is therefore pointed at /dev/null (os.dup2), and what it still buffered is
  flushed there: every later flush, and C code writing to fd 1 or 2 (torch's warnings), succeed;
- a descriptor closed before the start is opened on /dev/null, so that no file opened later (a
  checkpoint, metrics.jsonl) gets number 1 or 2 and receives what C code writes to the console.
tests/test_streams.py drives train_ppo.py with each stream broken or closed.
"""

import errno
import os
import sys

DEAD = {errno.EPIPE, errno.EBADF, errno.EIO, errno.ECONNRESET}  # the reader is gone, or the stream is


def _gone(e: Exception) -> bool:
    if isinstance(e, OSError):
        return e.errno in DEAD
    return isinstance(e, ValueError) and "closed file" in str(e)


def _to_devnull(fd: int) -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


class Guarded:
    """A text stream whose writes and flushes cannot fail once its reader is gone (the module
    docstring): it then drops them. Anything else is the wrapped stream's."""

    def __init__(self, stream):
        self.stream, self.dead = stream, False

    def write(self, s):
        if not self.dead:
            try:
                return self.stream.write(s)
            except (OSError, ValueError) as e:
                if not _gone(e):
                    raise
                self._die()
        return len(s)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        if not self.dead:
            try:
                self.stream.flush()
            except (OSError, ValueError) as e:
                if not _gone(e):
                    raise
                self._die()

    def _die(self):
        self.dead = True
        try:
            fd = self.stream.fileno()
        except (OSError, ValueError):  # closed, or not backed by a descriptor (a StringIO)
            return
        try:
            _to_devnull(fd)
            self.stream.flush()  # what it still buffers goes to /dev/null now, not to an error at exit
        except (OSError, ValueError):
            pass

    def __getattr__(self, name):  # encoding, isatty, fileno, buffer, ...
        return getattr(self.stream, name)


def guard() -> None:
    """Put sys.stdout and sys.stderr behind `Guarded` (once: a second call changes nothing)."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if isinstance(stream, Guarded):
            continue
        if stream is None:  # the descriptor was closed when Python started (`2>&-`)
            try:
                os.fstat(fd)
            except OSError:
                _to_devnull(fd)  # taken by /dev/null, not by the next file the run opens
            stream = open(os.devnull, "w")
        setattr(sys, name, Guarded(stream))
