"""Test-session set-up. With MSG_TF1_BEHAVIOUR set (tests/test_tf1_behaviour.py sets it for a
slice of the suite, in a fresh interpreter), TensorFlow runs as TF1 programs run on it:
`tf.compat.v1.disable_v2_behavior()` before any test builds a graph, so there is no eager
execution, shapes hold `Dimension`s, `tf.compat.v1` variables are reference variables and
control flow is TF1's. Tests marked `tf2_only` (eager execution, Keras 3) are skipped then.
"""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

TF1_BEHAVIOUR = bool(os.environ.get("MSG_TF1_BEHAVIOUR"))

if TF1_BEHAVIOUR:
    import tensorflow as tf

    tf.compat.v1.disable_v2_behavior()


#: Collected first, in this order. The first two are files of one test each that runs for
#: minutes in a fresh interpreter: with pytest-xdist (`-n 2 --dist loadfile
#: --no-loadscope-reorder`, the README's test command, which hands out files in this order)
#: each worker starts on one of them, and they run beside the rest of the suite, not after it.
#: Then test_memory.py, whose Session peaks read the allocator of the worker's own process:
#: it runs where only those subprocesses ran before it, since TensorFlow's allocator hands a
#: request a free block of up to twice its size whole, and blocks earlier tests left free
#: read as up to 1 MB more on its 1 MB chains.
RUN_FIRST = ("test_tf1_behaviour.py", "test_keras_hub.py", "test_memory.py")


def _run_first_index(item: pytest.Item) -> int:
    name = item.path.name
    return RUN_FIRST.index(name) if name in RUN_FIRST else len(RUN_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_run_first_index)
    if not TF1_BEHAVIOUR:
        return
    skip = pytest.mark.skip(reason="needs TF2 behaviour (eager execution or Keras 3)")
    for item in items:
        if item.get_closest_marker("tf2_only"):
            item.add_marker(skip)
