"""The compiled module (floor 1, over kinds): its instructions parsed once, walked once
(`read_schedule`), its reading a fold of that walk.
"""

from spmdtree._src.step.hlo.forms import overstated_bytes as overstated_bytes
from spmdtree._src.step.hlo.opcodes import Flash as Flash
from spmdtree._src.step.hlo.opcodes import Kept as Kept
from spmdtree._src.step.hlo.opcodes import flash_of as flash_of
from spmdtree._src.step.hlo.opcodes import innermost as innermost
from spmdtree._src.step.hlo.reading import Reading as Reading
from spmdtree._src.step.hlo.reading import reading_of as reading_of
from spmdtree._src.step.hlo.schedule import Branches as Branches
from spmdtree._src.step.hlo.schedule import Collective as Collective
from spmdtree._src.step.hlo.schedule import Copy as Copy
from spmdtree._src.step.hlo.schedule import Done as Done
from spmdtree._src.step.hlo.schedule import Event as Event
from spmdtree._src.step.hlo.schedule import Kernel as Kernel
from spmdtree._src.step.hlo.schedule import Loop as Loop
from spmdtree._src.step.hlo.schedule import Schedule as Schedule
from spmdtree._src.step.hlo.schedule import Start as Start
from spmdtree._src.step.hlo.schedule import read_schedule as read_schedule
