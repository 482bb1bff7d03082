# The public names of the package, listed once: type checkers and IDEs read them here, and
# `__init__.py` reads this file to load each name on its first use.
from memory_saving_gradients import keras as keras
from memory_saving_gradients import profiling as profiling
from memory_saving_gradients._src.analysis.measured import MeasuredCosts as MeasuredCosts
from memory_saving_gradients._src.analysis.view import ForwardView as ForwardView
from memory_saving_gradients._src.api import gradients as gradients
from memory_saving_gradients._src.api import gradients_collection as gradients_collection
from memory_saving_gradients._src.api import gradients_memory as gradients_memory
from memory_saving_gradients._src.api import gradients_speed as gradients_speed
from memory_saving_gradients._src.api import plan as plan
from memory_saving_gradients._src.integrations.patching import patch as patch
from memory_saving_gradients._src.integrations.patching import patched as patched
from memory_saving_gradients._src.integrations.patching import unpatch as unpatch
from memory_saving_gradients._src.integrations.tape import GradientTape as GradientTape
from memory_saving_gradients._src.planning.plans import Plan as Plan
from memory_saving_gradients._src.planning.policies import (
    CHECKPOINTS_COLLECTION as CHECKPOINTS_COLLECTION,
)
from memory_saving_gradients._src.planning.policies import MemoryBudget as MemoryBudget
from memory_saving_gradients._src.planning.policies import (
    NoCheckpointsError as NoCheckpointsError,
)
from memory_saving_gradients._src.planning.policies import add_checkpoint as add_checkpoint
from memory_saving_gradients.profiling import measure_costs as measure_costs

__version__: str
