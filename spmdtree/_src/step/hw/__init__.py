"""The hardware (floor 1, over kinds): chips as data, a `Hardware` that carries every
figure of its chip, the presets.
"""

from spmdtree._src.step.hw.chips import GpuChip as GpuChip
from spmdtree._src.step.hw.chips import TpuChip as TpuChip
from spmdtree._src.step.hw.chips import slice_dims as slice_dims
from spmdtree._src.step.hw.chips import torus_links as torus_links
from spmdtree._src.step.hw.chips import tpu_clock_ghz as tpu_clock_ghz
from spmdtree._src.step.hw.chips import wrapped as wrapped
from spmdtree._src.step.hw.grid import grid_share as grid_share
from spmdtree._src.step.hw.hardware import LINKS as LINKS
from spmdtree._src.step.hw.hardware import PRESETS as PRESETS
from spmdtree._src.step.hw.hardware import Costs as Costs
from spmdtree._src.step.hw.hardware import Frozen as Frozen
from spmdtree._src.step.hw.hardware import Hardware as Hardware
from spmdtree._src.step.hw.hardware import check_devices_per_node as check_devices_per_node
from spmdtree._src.step.hw.hardware import hardware as hardware
from spmdtree._src.step.hw.hardware import hardware_of as hardware_of
from spmdtree._src.step.hw.hardware import positive as positive
from spmdtree._src.step.hw.hardware import preset_in as preset_in
from spmdtree._src.step.hw.hardware import timed_on as timed_on
