"""One rank of tests/test_shutdown.py's exit race: a distca collective (which registers distca's exit
hook), then a last plain all-gather whose tensors are dropped at once, then the end of the script.
The gloo worker that ran the all-gather must take the GIL to drop them; without the hook it is often
still waiting when the interpreter finalizes, and the process aborts.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=P RANK=r WORLD_SIZE=2 python tests/exit_after_collective.py
"""

import numpy as np
import torch
import torch.distributed as dist

from distca_hf.runtime.comm import all_gather_documents

dist.init_process_group("gloo")
all_gather_documents([0], np.array([dist.get_rank() + 1]), None, "cpu", 30.0, "exit test")
gathered = [torch.empty(3) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, torch.ones(3))
del gathered
