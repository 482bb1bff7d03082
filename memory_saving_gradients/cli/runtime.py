"""The command's process-wide settings: quiet TensorFlow logs, each of the library's warnings
once, and the device steps run on.

Steps run with TensorFlow's own inter-op threads, as training does, and the command reports
the smallest peak of fresh builds: the executor orders ready ops differently from build to
build. Settings that TensorFlow reads when its runtime starts must come before
the first op runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator


class NoGpuError(RuntimeError):
    """A GPU was asked for and TensorFlow sees none."""


def quiet() -> None:
    """Keep TensorFlow's and Keras's informational output off the terminal.

    TF_CPP_MIN_LOG_LEVEL only takes effect where TensorFlow is not imported yet, and the
    native start-up notices ignore it; the absl and Python loggers and warnings filters take
    effect at once.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    _import_tensorflow_without_native_logs()
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)
    warnings.filterwarnings("ignore", module=r"(tensorflow|keras)(\.|$)")
    logging.getLogger("tensorflow").setLevel(logging.ERROR)


def _import_tensorflow_without_native_logs() -> None:
    """Import TensorFlow and Keras with the process's stderr closed: their native libraries
    write start-up notices (oneDNN, CUDA stubs, CPU features) before any log level applies.
    An import error still raises, and its traceback is printed once stderr is back."""
    stderr = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            import keras  # noqa: F401
            import tensorflow  # noqa: F401
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)


def warn_once() -> None:
    """Show the library's warnings on stderr, each distinct message once: every fresh build of
    a step would repeat them."""
    handler = logging.StreamHandler()
    handler.setFormatter(_UserFormatter())
    handler.addFilter(_FirstTime())
    logging.getLogger("memory_saving_gradients").addHandler(handler)


class _UserFormatter(logging.Formatter):
    """A record as its level and message ("warning: ..."): the module that logged it is the
    library's business, not the command's user's."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {record.getMessage()}"


class _FirstTime(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        first = message not in self._seen
        self._seen.add(message)
        return first


def start(device: str) -> str:
    """Start TensorFlow's runtime for `device` ('cpu', 'gpu', or 'auto': a GPU where there is
    one) and return the device whose memory steps are measured on ('CPU:0' or 'GPU:0').

    Raises:
      NoGpuError: `device` is 'gpu' and TensorFlow sees no GPU.
    """
    import tensorflow as tf

    with _stderr_kept_unless_failing():  # CUDA's start-up complaints on CPU-only machines
        gpus = tf.config.list_physical_devices("GPU")
    if device == "gpu" and not gpus:
        raise NoGpuError("TensorFlow sees no GPU")
    if device == "cpu" or not gpus:
        tf.config.set_visible_devices([], "GPU")
        return "CPU:0"
    tf.config.experimental.set_memory_growth(gpus[0], True)
    return "GPU:0"


def grow_allocator(mib: int, device: str = "CPU:0") -> None:
    """Make one free block of `mib` MiB, far larger than any step, and free it: each later
    request is cut from it to its size, so a peak reads what the step needs rather than the
    blocks this process's earlier steps left (the "grown allocator"). The block is allocated
    uninitialized, so its pages cost the process nothing until a step writes them."""
    import tensorflow as tf

    with tf.device(device):
        block = tf.raw_ops.Empty(shape=[mib * 2**20 // 4], dtype=tf.float32, init=False)
    del block


@contextlib.contextmanager
def _stderr_kept_unless_failing() -> Iterator[None]:
    """What native code writes to stderr inside is dropped, unless the block raises: then it
    is written out before the error propagates."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            captured.seek(0)
            sys.stderr.write(captured.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
